"""DP=2 rollouts under torchrun: an engine per replica, prompts split, weights refit in memory.

    python -m torch.distributed.run --nproc-per-node 2 tests/rollout_checks.py RECIPE CACHE RUN_DIR

Run by tests/test_rollout_dp.py; rank 0 prints one `RESULT {json}` line with every rank's
findings: whether it held an engine, how many prompts its engine generated, the engine's
log-probs against the trainer's before a refit (negative control: the policy was moved) and
after it, after a whole GRPO step (update, then refit), and after two asynchronous steps.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def _max_abs(a, b) -> float:
    a = torch.as_tensor(a, dtype=torch.float64)
    return float((a - torch.as_tensor(b, dtype=torch.float64)).abs().max())


def main(recipe_path: str, cache: str, run_dir: str) -> None:
    from megatron_ba.megatron.grpo_step import compute_logprobs
    from megatron_ba.parallel import collectives
    from megatron_ba.recipe import load_recipe
    from megatron_ba.train.driver import Trainer

    recipe = load_recipe(recipe_path, ["logging.plots=false"])
    trainer = Trainer(recipe, Path(run_dir), resume=False, cache_dir=Path(cache))
    out: dict = {"rank": trainer.ctx.rank, "dp": trainer.ctx.dp}
    try:
        ro, engine = trainer.rollouts, trainer.rollouts.engine
        out["has_engine"] = engine is not None and hasattr(engine, "llm")
        generated: list[int] = []
        inner = engine.generate

        def counting(prompt_ids, **kw):
            generated.append(len(prompt_ids))
            return inner(prompt_ids, **kw)

        engine.generate = counting
        tok = trainer.tokenizer
        ids = tok("3+4-1=6")["input_ids"] + [tok.eos_token_id]  # any fixed sequence
        tokens = torch.tensor([ids])

        def engine_vs_trainer() -> float:
            mine, _ = compute_logprobs(trainer.policy.chunks, tokens)
            return _max_abs(engine.prompt_logprobs(ids), mine[0, 1:])

        # 1. Move the policy (the same deterministic perturbation on both replicas): the engines
        #    are stale (negative control), then the in-memory refit brings them level.
        with torch.no_grad():
            g = torch.Generator().manual_seed(7)
            for p in trainer.policy.chunks[0].parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        out["stale_max_abs"] = engine_vs_trainer()
        out["sync_seconds"] = ro.sync(trainer.policy, 0)
        out["synced_max_abs"] = engine_vs_trainer()
        # 2. One round split over the two engines == rank 0's engine alone on the whole round.
        n_prompts = 5  # odd: unequal shares (3 + 2)
        if trainer.ctx.is_main:
            prompts = trainer.task.prompts("train", n_prompts)
            _, split = ro.generate(prompts, 2, 1.0, 1234)
            ro.end_batch()
            _, alone = ro.generate_local(prompts, 2, 1.0, 1234, recipe.grpo.max_new_tokens)
            out["split_groups"] = len(split)
            out["split_equals_single_engine"] = [[s.token_ids for s in grp] for grp in split] == [
                [s.token_ids for s in grp] for grp in alone
            ]
        else:
            ro.serve()
        out["prompts_generated_round"] = list(generated)
        # 3. A whole GRPO step: both engines generate their share, the update, the refit.
        generated.clear()
        before, _ = compute_logprobs(trainer.policy.chunks, tokens)
        record = trainer.train_step(0)
        after, _ = compute_logprobs(trainer.policy.chunks, tokens)
        out["step_moved_policy_max_abs"] = _max_abs(after, before)  # the refit had work to do
        out["prompts_generated_step"] = list(generated)
        out["refits"] = ro.refits
        out["after_step_max_abs"] = engine_vs_trainer()
        if trainer.ctx.is_main:
            out["step_reward_mean"] = record["reward_mean"]
            out["step_sync_seconds"] = record["time/sync"]
        # 4. Asynchronous steps (rollout.max_staleness = 1): step 2's batch generated now, step
        #    3's by both engines during step 2's update (v1 weights), trained at step 3.
        from megatron_ba.train.rollout_schedule import RolloutSchedule

        one = load_recipe(recipe_path, ["logging.plots=false", "rollout.max_staleness=1"])
        position = trainer.schedule.data_position
        trainer.schedule = RolloutSchedule(
            one, trainer.ctx, ro, task=trainer.task, scorer=trainer.scorer
        )
        trainer.schedule.data_position = position
        generated.clear()
        records = [trainer.train_step(1), trainer.train_step(2)]
        out["prompts_generated_async"] = list(generated)
        out["after_async_max_abs"] = engine_vs_trainer()
        out["engine_version"] = ro.version
        out["refits_after_async"] = ro.refits
        if trainer.ctx.is_main:
            out["async_staleness"] = [r["async/staleness_max"] for r in records]
            out["async_rewards"] = [r["reward_mean"] for r in records]
        shm = engine._shared.path
        out["shm_segment_existed"] = shm is not None and os.path.exists(shm)
        ro.close()  # the engine and its shared-memory segment (trainer.close repeats it: no-op)
        out["shm_segment_removed"] = not os.path.exists(shm)
        out["weights_dir_exists"] = (Path(run_dir) / ".weights").exists()
        ranks = collectives.all_gather_object(out)
        if out["rank"] == 0:
            print("RESULT " + json.dumps(ranks), flush=True)
    finally:
        trainer.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
