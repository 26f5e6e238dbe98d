"""Checks of the drop-ins, run inside a light environment (tests/light_install.py):

    LIGHT_ENV/bin/python -I tests/light_probe.py CHECK [CHECK ...] --absent megatron,vllm

First each `--absent` module must not be found (the environment is what it claims), then the
checks run in this one process (they share their imports: run a check alone to see its own), then
every megatron_ba module loaded must be the wheel's (a file of the light environment's own
site-packages, not of a linked environment nor of the checkout) and no absent module imported.
Exit status 0, or a traceback naming what failed.

- verl: `import megatron_ba.integrations.verl` registers `balanced` / `balanced_mass` in verl's
  registries; the `balanced` estimator and policy loss run on a small batch and their loss equals
  the core's balanced plan applied directly.
- verl_main: the entry module imports, and `python -m megatron_ba.integrations.verl.main_ppo
  --help` composes verl's config (exit 0, verl's config printed).
- trl: a `BalancedGRPOTrainer` is built on a tiny Qwen2 (built here, offline) and its planning
  (`attach_plan`) gives the core's balanced weights.
- nemo_rl: `BalancedPGLossFn` and the entry script's module import. Without NeMo-RL, making the
  loss function is an ImportError saying it runs inside NeMo-RL; with it, the loss function plans
  a small global batch (`attach_plan`, the core's weights) and is called on it.
- import:MODULE: `import MODULE`, nothing more.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import sys
import sysconfig
import tempfile
from pathlib import Path

G = 4  # responses per prompt


def _batch():
    """(lengths [8], scores [8], group ids [8], mask [8, 6]): two groups of G, both mixed."""
    import torch

    lengths = torch.tensor([3, 5, 2, 6, 4, 1, 6, 2])
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    group_ids = torch.arange(8) // G
    mask = (torch.arange(6)[None, :] < lengths[:, None]).double()
    return lengths, scores, group_ids, mask


def _core_weights(lengths, advantages, group_ids):
    from megatron_ba import sequence_weights

    return sequence_weights("balanced", lengths, advantages, group_ids)


def check_verl() -> None:
    import numpy as np
    import torch
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig

    import megatron_ba.integrations.verl  # noqa: F401  (registers the hooks)
    from megatron_ba import GRPOLossConfig, LossPlan, group_advantages, grpo_loss

    for rule in ("balanced", "balanced_mass"):
        assert rule in core_algos.ADV_ESTIMATOR_REGISTRY, f"estimator {rule} not registered"
        assert rule in core_algos.POLICY_LOSS_REGISTRY, f"policy loss {rule} not registered"
    lengths, scores, group_ids, mask = _batch()
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(8), lengths - 1] = scores  # outcome reward on the last token
    uid = np.array([f"prompt-{int(g)}" for g in group_ids], dtype=object)
    estimator = core_algos.get_adv_estimator_fn("balanced")
    folded, _ = estimator(rewards, mask, index=uid, config=AlgoConfig())
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3
    new = (old + 0.3 * torch.randn(mask.shape, generator=g, dtype=torch.float64)).requires_grad_()
    config = ActorConfig(strategy="fsdp", rollout_n=G, ppo_micro_batch_size_per_gpu=2)
    loss_fn = core_algos.get_policy_loss_fn("balanced")
    loss, _ = loss_fn(old, new, folded, mask, "token-mean", config)
    loss.backward()
    assert torch.isfinite(loss) and float(new.grad.abs().sum()) > 0, loss
    a = group_advantages(scores, group_ids, std="sample", eps=1e-6).advantages
    w = _core_weights(lengths, a, group_ids)
    plan = LossPlan(pg_weights=w, reg_weights=w, advantages=a)
    clip = GRPOLossConfig(clip_low=config.clip_ratio, clip_high=config.clip_ratio, dual_clip=3.0)
    ref, _ = grpo_loss(new.detach(), old, mask.bool(), plan, clip)
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-9, atol=1e-12)


def check_verl_main() -> None:
    from megatron_ba.integrations.verl import main_ppo

    # What `python -m megatron_ba.integrations.verl.main_ppo --help` runs, in this process
    # (a second interpreter would import verl again: ~10 s).
    argv, sys.argv = sys.argv, ["main_ppo.py", "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            main_ppo.main()
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = argv
    assert code in (0, None), f"main_ppo --help: exit {code}\n{out.getvalue()}"
    assert "adv_estimator" in out.getvalue(), f"main_ppo --help: no verl config\n{out.getvalue()}"


def check_trl() -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from megatron_ba.integrations.trl import BalancedGRPOTrainer
    from megatron_ba.testing.tiny_hf import build_tiny_qwen2

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_qwen2(Path(tmp) / "tiny", num_layers=1)
        args = GRPOConfig(
            output_dir=str(Path(tmp) / "out"),
            per_device_train_batch_size=G,
            num_generations=G,
            max_completion_length=6,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
        )
        trainer = BalancedGRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir),
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["1 + 1 ="] * G}),
            processing_class=AutoTokenizer.from_pretrained(model_dir),
            aggregation="balanced",
        )
    lengths, scores, group_ids, mask = _batch()
    advantages = scores - scores.view(-1, G).mean(1).repeat_interleave(G)
    batch = trainer.attach_plan({"completion_mask": mask.long(), "advantages": advantages.float()})
    expected = _core_weights(lengths, advantages, group_ids)
    torch.testing.assert_close(batch["ba_weights"], expected, rtol=1e-6, atol=0)


def check_nemo_rl() -> None:
    import torch

    from megatron_ba.integrations.nemo_rl import (
        BalancedPGLossFn,
        run_grpo_balanced,  # noqa: F401
    )

    cfg = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.28}
    if importlib.util.find_spec("nemo_rl") is None:  # the loss function is NeMo-RL's to run
        try:
            BalancedPGLossFn(cfg, group_size=G)
        except ImportError as e:
            assert "BalancedPGLossFn runs inside NeMo-RL" in str(e), e
            return
        raise AssertionError("BalancedPGLossFn was made without NeMo-RL")
    lengths, scores, group_ids, mask = _batch()
    advantages = scores - scores.view(-1, G).mean(1).repeat_interleave(G)
    n, t = mask.shape
    token_mask = torch.cat([torch.zeros(n, 1), mask.float()], dim=1)  # NeMo-RL: shifted by one
    g = torch.Generator().manual_seed(0)
    data = {
        "token_mask": token_mask,
        "sample_mask": torch.ones(n),
        "advantages": advantages.float()[:, None] * token_mask,
        **{k: -torch.rand(n, t + 1, generator=g) for k in LOGPROB_KEYS},
    }
    loss_fn = BalancedPGLossFn(cfg, group_size=G)
    loss_fn.attach_plan(data)
    expected = _core_weights(lengths, advantages, group_ids)
    torch.testing.assert_close(data["ba_weights"], expected.to(data["ba_weights"].dtype))
    loss, metrics = loss_fn(data["prev_logprobs"][:, 1:] + 0.1, data, None, None)
    assert torch.isfinite(loss) and "token_mult_prob_error" in metrics, (loss, metrics)


# What GRPO's train_data holds besides the masks and advantages (NeMo-RL's KL is on by default).
LOGPROB_KEYS = ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs")


CHECKS = {
    "verl": check_verl,
    "verl_main": check_verl_main,
    "trl": check_trl,
    "nemo_rl": check_nemo_rl,
}


def _check_sources(absent: list[str]) -> None:
    """Every loaded megatron_ba module is the wheel's; no absent module was imported."""
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "megatron_ba" and getattr(module, "__file__", None):
            where = Path(module.__file__).resolve()
            assert where.is_relative_to(site), f"{name} was loaded from {where}, not from {site}"
    imported = sorted({m.split(".")[0] for m in sys.modules} & set(absent))
    assert not imported, f"imported {imported}, which this environment should not have"


def main() -> None:
    parser = argparse.ArgumentParser(description="checks of drop-ins in a light environment")
    parser.add_argument(
        "checks", nargs="+", help=f"any of {sorted(CHECKS)}, or import:MODULE (imports MODULE)"
    )
    parser.add_argument("--absent", default="", help="comma-separated top-level modules")
    args = parser.parse_args()
    unknown = [c for c in args.checks if c not in CHECKS and not c.startswith("import:")]
    if unknown:
        parser.error(f"checks: unknown {unknown}; choose from {sorted(CHECKS)} or import:MODULE")
    absent = [m for m in args.absent.split(",") if m]
    for name in absent:
        spec = importlib.util.find_spec(name)
        assert spec is None, f"{name} can be imported here ({spec.origin}): not a light environment"
    for check in args.checks:
        if check.startswith("import:"):
            importlib.import_module(check.removeprefix("import:"))
        else:
            CHECKS[check]()
    _check_sources(absent)
    print(f"ok: {' '.join(args.checks)}")


if __name__ == "__main__":
    main()
