"""Checks of the local backend that need megatron-core state and a vLLM engine (one process each).

    python tests/train_checks.py sync RECIPE CACHE_DIR           # HF <-> megatron <-> vLLM
    python tests/train_checks.py resume RECIPE RUN_DIR CACHE_DIR # restored state == saved state

Run by tests/test_train_*.py in subprocesses (megatron-core's parallel state is process-global);
each prints one JSON line of results that the tests assert on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def _max_abs(a, b) -> float:
    return float(
        (torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64))
        .abs()
        .max()
    )


def check_sync(recipe_path: str, cache: str) -> dict:
    import tempfile

    from transformers import Qwen2ForCausalLM

    from megatron_ba.conversion import hf_named_tensors, megatron_state_dict_from_hf
    from megatron_ba.megatron.grpo_step import compute_logprobs
    from megatron_ba.parallel.full_shape import gather_full_state_dict
    from megatron_ba.recipe import load_recipe
    from megatron_ba.train.driver import Trainer

    out: dict = {}
    recipe = load_recipe(recipe_path)
    run_dir = Path(tempfile.mkdtemp(prefix="sync-"))
    trainer = Trainer(recipe, run_dir, resume=False, cache_dir=Path(cache))
    try:
        spec = trainer.policy.spec
        # 1. HF -> megatron -> HF is the identity on the warm-start weights.
        hf = Qwen2ForCausalLM.from_pretrained(trainer.hf_dir, torch_dtype=torch.float32).eval()
        hf_sd = {k: v for k, v in hf.state_dict().items() if "rotary" not in k}
        back = dict(hf_named_tensors(megatron_state_dict_from_hf(hf_sd, spec), spec))
        out["roundtrip_max_abs"] = max(_max_abs(back[k], hf_sd[k]) for k in hf_sd)
        out["roundtrip_same_keys"] = set(back) == set(hf_sd)
        # 2. The megatron policy's log-probs equal transformers' on the same weights.
        tok = trainer.tokenizer
        prompt = trainer.task.prompts("eval", 1)[0]
        from megatron_ba.tasks.arithmetic import correct_solution

        ids = tok(prompt + correct_solution(prompt))["input_ids"] + [tok.eos_token_id]
        tokens = torch.tensor([ids])
        mega, _ = compute_logprobs(trainer.policy.chunks, tokens)
        with torch.no_grad():
            logits = hf(tokens).logits.double()
        ref = torch.log_softmax(logits, -1)[0, :-1].gather(1, tokens[0, 1:, None])[:, 0]
        out["megatron_vs_hf_max_abs"] = _max_abs(mega[0, 1:], ref)
        # 3. Move the policy away from the engine's weights (a deterministic perturbation).
        with torch.no_grad():
            g = torch.Generator().manual_seed(7)
            for p in trainer.policy.chunks[0].parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        moved, _ = compute_logprobs(trainer.policy.chunks, tokens)
        stale = trainer.rollouts.engine.prompt_logprobs(ids)
        out["stale_vllm_vs_megatron_max_abs"] = _max_abs(stale, moved[0, 1:])  # negative control
        trainer.rollouts.sync(trainer.policy, 0)
        synced = trainer.rollouts.engine.prompt_logprobs(ids)
        out["synced_vllm_vs_megatron_max_abs"] = _max_abs(synced, moved[0, 1:])
        out["num_tokens"] = len(ids) - 1
        # 4. The built-in sampler's left padding is invisible: the next-token logits of a padded
        #    row equal those of the row alone.
        from megatron_ba.generation.builtin_sampler import BuiltinSampler

        short, long_ = ids[:5], ids[:9]
        pad = tok.pad_token_id
        rows = torch.tensor([[pad] * 4 + short, long_])
        valid = torch.tensor([[False] * 4 + [True] * 5, [True] * 9])
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        from megatron_ba.megatron.batching import causal_mask

        mask = causal_mask(9, valid=valid)
        both = trainer.policy.full_vocab_forward(rows, positions, mask)[:, -1]
        alone = trainer.policy.full_vocab_forward(
            torch.tensor([short]), torch.arange(5)[None], causal_mask(5)
        )[:, -1]
        out["builtin_padding_max_abs"] = _max_abs(both[0], alone[0])
        unmasked = trainer.policy.full_vocab_forward(
            rows, torch.arange(9).expand(2, 9), causal_mask(9)
        )
        out["builtin_unmasked_padding_max_abs"] = _max_abs(unmasked[0, -1], alone[0])  # control
        sampler = BuiltinSampler(
            trainer.policy.full_vocab_forward,
            eos_token_id=tok.eos_token_id,
            pad_token_id=pad,
            decode=lambda t: tok.decode(t, skip_special_tokens=True),
        )
        got = sampler.generate([short, long_], n=2, temperature=1.0, max_tokens=6, seed=0)
        out["builtin_shapes"] = [len(g) for g in got]
        out["builtin_max_len"] = max(len(x.token_ids) for g in got for x in g)
        full = gather_full_state_dict(trainer.policy.chunks)
        out["num_parameters"] = sum(t.numel() for t in full.values())
    finally:
        trainer.close()
    return out


def _saved_tensors(dist_dir: Path) -> dict:
    """A dist checkpoint's full tensors by ShardedTensor key, read by torch's own converter
    (independent of megatron-core's loader that the resume uses)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(dist_dir, Path(tmp) / "full.pt")
        return torch.load(Path(tmp) / "full.pt", weights_only=False)


def _equal_to_saved(sharded_sd: dict, saved: dict) -> tuple[bool, int]:
    """Every local shard of `sharded_sd` equals its slice of the saved full tensors."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    same, n = True, 0
    for v in nested_values(sharded_sd):
        parts = nested_values(v.build()) if isinstance(v, ShardedTensorFactory) else [v]
        for sh in parts:
            if isinstance(sh, ShardedTensor):
                n += 1
                same &= torch.equal(saved[sh.key][sh.global_slice()], sh.data)
    return bool(same), n


def check_resume(recipe_path: str, run_dir: str, cache: str) -> dict:
    from megatron_ba.recipe import load_recipe
    from megatron_ba.train import checkpoint
    from megatron_ba.train.driver import Trainer
    from megatron_ba.train.run_log import MetricsLog

    run = Path(run_dir)
    ckpt = checkpoint.latest_dir(run)
    saved = _saved_tensors(ckpt / checkpoint.DIST)
    common = torch.load(ckpt / checkpoint.DIST / "common.pt", weights_only=False)
    saved_rng = torch.load(ckpt / checkpoint.RNG / "rank-00000.pt", weights_only=False)
    meta = json.loads((ckpt / "meta.json").read_text())
    recipe = load_recipe(run / "recipe.yaml")
    trainer = Trainer(recipe, run, resume=True, cache_dir=Path(cache))
    out: dict = {"checkpoint_step": meta["step"], "start_step": trainer.start_step}
    try:
        p = trainer.policy
        sd = checkpoint._sharded_state(p.chunks, p.optimizer)
        out["weights_equal"], out["num_weight_shards"] = _equal_to_saved(sd["model"], saved)
        out["optimizer_equal"], _ = _equal_to_saved(sd["optimizer"], saved)
        opt = p.optimizer.optimizer.state_dict()
        out["optimizer_steps"] = sorted({int(s["step"]) for s in opt["state"].values()})
        out["saved_optimizer_step"] = common["optimizer"]["step"]
        out["torch_rng_equal"] = torch.equal(torch.get_rng_state(), saved_rng["torch"])
        out["steps_logged_before"] = [r["step"] for r in MetricsLog(run / "metrics.jsonl").read()]
        trainer.run()
    finally:
        trainer.close()
    out["steps_logged_after"] = [r["step"] for r in MetricsLog(run / "metrics.jsonl").read()]
    out["summary"] = (run / "summary.json").is_file()
    out["plots"] = sorted(p.name for p in (run / "plots").glob("*.png"))
    out["checkpoint_hf"] = any((run / "checkpoints").glob("step-*/hf"))
    out["run_hf"] = (run / "hf" / "config.json").is_file()
    return out


if __name__ == "__main__":
    what = sys.argv[1]
    result = check_sync(*sys.argv[2:4]) if what == "sync" else check_resume(*sys.argv[2:5])
    print("RESULT " + json.dumps(result))
