"""NeMo-RL's GRPO (examples/run_grpo.py) with `BalancedPGLossFn` swapped in.

    cd <NeMo-RL checkout> && uv run python -m megatron_ba.integrations.nemo_rl.run_grpo_balanced \\
        --config examples/configs/grpo_math_1B.yaml ++loss_fn.ba_rule=balanced

Arguments are NeMo-RL's own (they go to its examples/run_grpo.py, found from NEMO_RL_ROOT or next
to the installed `nemo_rl` package). Before running it, this wraps `nemo_rl.algorithms.grpo.setup`:
its result's loss function is replaced by BalancedPGLossFn(master_config["loss_fn"], group_size=
grpo.num_generations_per_prompt), and the returned policy's `train(data, loss_fn, ...)` first
calls `loss_fn.attach_plan(data)` on the global batch. Positions in setup's result and the call
`policy.train(train_data, loss_fn, ...)` are NeMo-RL v0.7.0's, checked by the contract test
(tests/test_integration_nemo_rl.py). NeMo-RL needs Ray and GPUs; what has run: docs/status.md.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys

from megatron_ba.integrations.nemo_rl.loss import BalancedPGLossFn

# Indices in the tuple grpo.setup returns (v0.7.0; the contract test checks them).
SETUP_POLICY, SETUP_LOSS_FN, SETUP_MASTER_CONFIG = 0, 6, 10


def _one_global_batch(master_config) -> int:
    grpo, policy = master_config["grpo"], master_config["policy"]
    group_size = int(grpo["num_generations_per_prompt"])
    per_step = int(grpo["num_prompts_per_step"]) * group_size
    if int(policy["train_global_batch_size"]) != per_step:
        # policy.train splits a larger batch into several optimizer steps after sharding it
        # over DP ranks; the plan is built for one global batch, the whole rollout.
        raise ValueError(
            f"policy.train_global_batch_size: must equal grpo.num_prompts_per_step * "
            f"num_generations_per_prompt = {per_step} for BalancedPGLossFn (one optimizer step "
            f"per rollout batch), got {policy['train_global_batch_size']}"
        )
    return group_size


def balanced_setup(setup):
    """Wrap grpo.setup: swap the loss function, make policy.train attach the plan first."""

    @functools.wraps(setup)
    def wrapped(*args, **kwargs):
        result = list(setup(*args, **kwargs))
        master_config = result[SETUP_MASTER_CONFIG]
        group_size = _one_global_batch(master_config)
        loss_fn = BalancedPGLossFn(master_config["loss_fn"], group_size=group_size)
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


def main() -> None:
    from nemo_rl.algorithms import grpo

    grpo.setup = balanced_setup(grpo.setup)
    path = _run_grpo_path()
    sys.argv = [path, *sys.argv[1:]]
    runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    main()
