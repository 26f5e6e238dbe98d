"""NeMo-RL's GRPO (examples/run_grpo.py) with `BalancedPGLossFn` swapped in.

    python -m megatron_ba.integrations.nemo_rl.run_grpo_balanced \\
        --config examples/configs/grpo_math_1B.yaml ++loss_fn.ba_rule=balanced [--check]

Run it in NeMo-RL's environment (from a NeMo-RL checkout: `uv run python -m ...`). Arguments are
NeMo-RL's own: they go to its examples/run_grpo.py, found from NEMO_RL_ROOT or next to the installed
`nemo_rl` package. First the config is built as run_grpo.py builds it and checked
(`check_master_config`, and the loss settings BalancedPGLossFn refuses): a refusal stops the run
before Ray or any model starts; `--check` stops after the check. Then nemo_rl_preflight.py puts the
tokenizer, the data and the math reward through NeMo-RL's own code; without a CUDA GPU it prints one
line (`[megatron-ba] nemo_rl: checked MasterConfig, ...: stopping before training`) and exits with
status NEEDS_GPU (69, integrations/exit_status.py). With a GPU, NeMo-RL's
`nemo_rl.algorithms.grpo.setup` is wrapped (`balanced_setup`): the loss function in its result is
replaced by BalancedPGLossFn(master_config.loss_fn, group_size=grpo.num_generations_per_prompt,
step_size=policy.train_global_batch_size), and the returned policy's `train(data, loss_fn, ...)`
first calls `loss_fn.attach_plan(data)` on the global batch, in `grpo_train` and in
`async_grpo_train` (`grpo.async_grpo.enabled`: whole prompt groups of any policy versions,
`_check_async`). Positions in setup's result and the call `policy.train(train_data, loss_fn, ...)`
are NeMo-RL v0.7.0's; tests/nemorl/ runs them against its code. What has run: docs/status.md.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys

from megatron_ba.integrations.nemo_rl import nemo_rl_preflight as preflight
from megatron_ba.integrations.nemo_rl.pg_loss import BalancedPGLossFn

# Indices in the tuple grpo.setup returns (NeMo-RL v0.7.0: policy, policy_generation, nemo_gym,
# clusters, dataloader, val_dataloader, loss_fn, logger, checkpointer, grpo_save_state,
# master_config, teacher_worker_groups, alias_to_group_alias).
SETUP_POLICY, SETUP_LOSS_FN, SETUP_MASTER_CONFIG = 0, 6, 10


def check_master_config(master_config) -> dict[str, int]:
    """BalancedPGLossFn's sizes (group_size, step_size), after refusing a NeMo-RL `MasterConfig`
    the plan cannot serve.

    An optimizer step of `policy.train_global_batch_size` rows: policy.train cuts the rollout
    batch into consecutive chunks of that size, one per step, so the size must be whole groups and
    divide the batch (each step then gets the plan of its own groups). The synchronous trainers:
    `grpo_train` holds the batch on the driver, where the plan is built; the data-plane one
    (`data_plane.enabled`) never does. Async GRPO (`_check_async`) trains on whole prompt groups.
    """
    grpo, policy = master_config.grpo, master_config.policy
    group_size = int(grpo["num_generations_per_prompt"])
    per_batch = int(grpo["num_prompts_per_step"]) * group_size
    step_size = int(policy["train_global_batch_size"])
    if step_size % group_size or per_batch % step_size:
        raise ValueError(
            f"policy.train_global_batch_size: must be whole groups of num_generations_per_prompt "
            f"= {group_size} and divide num_prompts_per_step * num_generations_per_prompt = "
            f"{per_batch} for BalancedPGLossFn (each optimizer step plans its own whole groups), "
            f"got {step_size}"
        )
    async_grpo = grpo.get("async_grpo") or {}
    if async_grpo.get("enabled", False):
        _check_async(async_grpo)
    elif (master_config.data_plane or {}).get("enabled", False):
        # run_grpo.py picks the TransferQueue trainer only when async GRPO is off.
        raise ValueError(
            "data_plane.enabled: must be false for BalancedPGLossFn (the TransferQueue trainer "
            "hands the workers batch metadata, never the whole batch to plan on the driver)"
        )
    return {"group_size": group_size, "step_size": step_size}


def _check_async(async_grpo) -> None:
    """Async GRPO (NeMo-RL v0.7.0's async_grpo_train) as BalancedPGLossFn needs it.

    What the plan needs holds there for every policy version and age: the replay buffer holds one
    entry per prompt, its num_generations_per_prompt responses scored together; a step samples
    num_prompts_per_step entries and concatenates them (BatchedDataDict.from_batches), so the
    training batch is whole groups in contiguous blocks, the layout attach_plan reads, and
    policy.train cuts it as in synchronous GRPO. A version enters each token's ratio and
    importance weight through generation_logprobs, never the plan (docs/math.md, section 10).
    The age must be >= 1: NeMo-RL sizes its buffer as num_prompts_per_step * age * 2 entries, so
    0 fails inside its Ray actor, after the models have loaded.
    """
    age = async_grpo.get("max_trajectory_age_steps")
    if isinstance(age, bool) or not (isinstance(age, int) and age >= 1):
        raise ValueError(
            "grpo.async_grpo.max_trajectory_age_steps: must be an integer >= 1 (NeMo-RL's replay "
            "buffer holds num_prompts_per_step * max_trajectory_age_steps * 2 prompt groups; "
            f"any age keeps BalancedPGLossFn's groups whole), got {age!r}"
        )


def balanced_setup(setup):
    """Wrap grpo.setup: swap the loss function, make policy.train attach the plan first."""

    @functools.wraps(setup)
    def wrapped(master_config, *args, **kwargs):
        # Refused settings stop the run here, before setup starts Ray and loads any model.
        BalancedPGLossFn(master_config.loss_fn, **check_master_config(master_config))
        result = list(setup(master_config, *args, **kwargs))
        master_config = result[SETUP_MASTER_CONFIG]
        loss_fn = BalancedPGLossFn(master_config.loss_fn, **check_master_config(master_config))
        policy = result[SETUP_POLICY]
        train = policy.train

        def train_with_plan(data, loss_fn_arg, *a, **kw):
            if isinstance(loss_fn_arg, BalancedPGLossFn):
                loss_fn_arg.attach_plan(data)
            return train(data, loss_fn_arg, *a, **kw)

        policy.train = train_with_plan
        result[SETUP_LOSS_FN] = loss_fn
        return tuple(result)

    return wrapped


def _run_grpo_path() -> str:
    root = os.environ.get("NEMO_RL_ROOT")
    if root is None:
        import nemo_rl

        root = os.path.dirname(os.path.dirname(os.path.abspath(nemo_rl.__file__)))
    path = os.path.join(root, "examples", "run_grpo.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"NEMO_RL_ROOT: {path} not found; set NEMO_RL_ROOT to a NeMo-RL checkout"
        )
    return path


def load_master_config(argv: list[str], run_grpo: str):
    """The MasterConfig examples/run_grpo.py builds from these arguments, built the same way
    (NeMo-RL's load_config, parse_hydra_overrides, resolvers; its default config file)."""
    import argparse

    from nemo_rl.algorithms.grpo import MasterConfig
    from nemo_rl.utils.config import load_config, parse_hydra_overrides
    from nemo_rl.utils.config import register_omegaconf_resolvers as register
    from omegaconf import OmegaConf

    register()
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config", default=None)
    args, overrides = parser.parse_known_args(argv)
    path = args.config or os.path.join(os.path.dirname(run_grpo), "configs", "grpo_math_1B.yaml")
    config = load_config(path)
    if overrides:
        config = parse_hydra_overrides(config, overrides)
    return MasterConfig(**OmegaConf.to_container(config, resolve=True))


def main() -> None:
    """Check the config as run_grpo.py will build it, then run run_grpo.py with the swap.
    `--check` (not passed on) stops after the check."""
    from nemo_rl.algorithms import grpo

    argv = [a for a in sys.argv[1:] if a != "--check"]
    path = _run_grpo_path()
    master_config = load_master_config(argv, path)
    loss_fn = BalancedPGLossFn(master_config.loss_fn, **check_master_config(master_config))
    s = loss_fn.aggregation
    kl = loss_fn.reference_policy_kl_penalty
    print(
        f"[megatron-ba] checked: BalancedPGLossFn rule={s.rule} scope={s.scope}, group size "
        f"{loss_fn.group_size}, {loss_fn.step_size} sequences per optimizer step, KL "
        f"coefficient {kl}",
        flush=True,
    )
    if "--check" in sys.argv[1:]:
        return
    # The tokenizer, data and reward through NeMo-RL's own code; without a GPU, the one line and
    # exit status NEEDS_GPU (nemo_rl_preflight.py), before grpo.setup starts any worker.
    preflight.check_or_stop(master_config)
    grpo.setup = balanced_setup(grpo.setup)
    sys.argv = [path, *argv]
    runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    main()
