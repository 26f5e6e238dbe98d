"""The local GRPO driver: megatron-core policy, vLLM rollouts, verifiable rewards, the BA plan.

    megatron-ba train recipes/tiny-cpu.yaml [key=value ...] [--run-dir DIR] [--resume DIR]
    megatron-ba train --nproc-per-node 2 recipes/tiny-cpu-tp2.yaml
    megatron-ba train --nproc-per-node 2 recipes/tiny-moe-cpu.yaml   # DP2 x EP2

One step: rank 0 picks P prompts, each data-parallel replica's engine samples G responses for
its share of them and rank 0 scores them all (train/rollouts.py, train/scoring.py); every rank
receives the batch (train/experience.py), takes its data-parallel rows, computes the old
log-probs and runs the GRPO loss through megatron-core's schedule, the plan's statistics
all-reduced once over DP (train/update.py); then each engine is refit in memory from its
replica's shards. Evaluation (Acc@k at the sampling temperature on held-out prompts, through
the same runner as `megatron-ba eval`) runs at step 0 (the warm-start policy), every
`eval.every` steps and at the end; checkpoints (train/checkpoint.py) every `checkpoint.every`
steps; the run folder's files are written by train/run_log.py. This module only orchestrates.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from megatron_ba.diagnostics import batch_diagnostics
from megatron_ba.megatron.startup import setup, teardown
from megatron_ba.parallel.parallel_layout import RECIPE_KEYS
from megatron_ba.recipe import Recipe
from megatron_ba.tasks import build_task
from megatron_ba.tokenization import load_hf_tokenizer, load_tokenizer
from megatron_ba.train import checkpoint, preemption
from megatron_ba.train.experience import build_experience
from megatron_ba.train.plots import plot_run
from megatron_ba.train.policy import Policy
from megatron_ba.train.rollout_schedule import RolloutSchedule, seed_for
from megatron_ba.train.rollouts import Rollouts
from megatron_ba.train.run_log import RunFolder
from megatron_ba.train.scoring import Scorer
from megatron_ba.train.update import grpo_update
from megatron_ba.train.warmstart import run_warmstart


class Trainer:
    """One run on this rank. `run()` trains to the recipe's last step; `close()` frees it."""

    def __init__(
        self, recipe: Recipe, run_dir: Path, *, resume: bool, cache_dir: Path, log=print
    ) -> None:
        self.recipe, self.log = recipe, log
        self.step_settings = recipe.step_settings()  # the update's, built once
        self.folder = RunFolder(run_dir)
        self.run_dir = self.folder.path
        self.rollouts = self.scorer = None
        self.ctx = setup(recipe.parallel.layout(), seed=recipe.seed, names=RECIPE_KEYS)
        if recipe.rollout.threads:
            torch.set_num_threads(recipe.rollout.threads)
        if self.ctx.is_main:
            self.folder.prepare(recipe, resume=resume)
        self.ctx.barrier()
        self._build(resume, cache_dir)

    def _build(self, resume: bool, cache_dir: Path) -> None:
        recipe, ctx = self.recipe, self.ctx
        # The synthetic task: a fresh tiny policy, warm-started (cached).
        if recipe.warmstart.enabled:
            hf_dir = ctx.broadcast(
                str(run_warmstart(recipe, cache_dir, log=self.log)) if ctx.is_main else None
            )
            self.hf_dir = Path(hf_dir)
        else:  # a Hugging Face checkpoint
            self.hf_dir = Path(recipe.model.pretrained)
        if recipe.tokenizer.kind == "hf":  # the checkpoint's own tokenizer and chat template
            self.tokenizer = load_hf_tokenizer(recipe.tokenizer.path or self.hf_dir)
        else:  # trained-bpe: the one the warm start trained and saved beside its model
            self.tokenizer = load_tokenizer(self.hf_dir)
        self.policy = Policy.from_hf(
            self.hf_dir, recipe, is_main=ctx.is_main, layout=ctx.layout, device=ctx.device
        )
        self.task = build_task(recipe, self.tokenizer) if ctx.is_main else None
        if self.task is not None and getattr(self.task, "report", None):
            self.log(f"[data] {self.task.report}")
        # The layout as the model was built (its config's sequence parallelism); after the data,
        # whose errors are the run's one line.
        if ctx.is_main:
            built = replace(
                ctx.layout, sequence_parallel=self.policy.chunks[0].config.sequence_parallel
            )
            self.log(f"[layout] {built}")
        self.start_step = 0
        data_position, pending = 0, None  # prompts drawn so far; the batch waiting for its step
        if resume:
            ckpt = checkpoint.latest_dir(self.run_dir)
            if ckpt is None:
                raise FileNotFoundError(f"--resume: no complete checkpoint in {self.run_dir}")
            policy = self.policy  # any saved TP / PP / DP layout; RNG: see checkpoint.py's policy
            meta = checkpoint.load(
                ctx, ckpt, policy.chunks, policy.optimizer, seed=recipe.seed, log=self.log
            )
            self.start_step, data_position = meta["step"], meta["data_position"]
            pending = checkpoint.load_pending(ckpt) if ctx.is_main else None
            if ctx.is_main:
                self.folder.truncate_after(self.start_step)
                self.log(f"[resume] from {ckpt} (step {self.start_step})")
        if ctx.is_main:  # after the resume: its step is where the trackers' history ends
            self.folder.start_tracking(recipe, resume_step=self.start_step)
        self.rollouts = Rollouts.start(
            recipe, ctx, self.hf_dir, self.run_dir, self.tokenizer, self.policy
        )
        if ctx.is_main:
            self.scorer = Scorer(
                self.task,
                recipe,
                self.tokenizer,
                context=self.policy.spec.max_context,
            )
        self.schedule = RolloutSchedule(
            recipe, ctx, self.rollouts, task=self.task, scorer=self.scorer, log=self.log
        )
        self.schedule.restore(data_position, pending)
        if resume:  # the engine starts from the checkpoint's weights
            self.rollouts.sync(self.policy, self.start_step)

    # -- one step -------------------------------------------------------------------------
    def evaluate(self, step: int) -> dict:
        """Acc@k / Best@k on the benchmarks (or held-out prompts) at the eval temperature
        (rank 0; {} elsewhere)."""
        if not self.ctx.is_main:
            return {}
        seed = seed_for(self.recipe.seed, step, "eval")
        return self.scorer.evaluate(self.rollouts, seed=seed)

    def train_step(self, step: int, *, refit_before: bool = False) -> dict:
        """Rollouts, rewards, the GRPO update and the weight sync; the step's metrics (rank 0).
        With rollout.max_staleness > 0 the next step's first round is generated during the
        update (train/rollout_schedule.py); `refit_before`: an evaluation or a checkpoint
        follows (the engines are refit for it)."""

        recipe, ctx, grpo = self.recipe, self.ctx, self.recipe.grpo
        timings: dict[str, float] = {}
        schedule, started = self.schedule, time.perf_counter()
        busy_before = self.rollouts.busy_seconds
        batch = schedule.take(step)
        exp = None
        if ctx.is_main:
            self.folder.log_samples(step + 1, batch.prompts, batch.samples, batch.rewards)
            exp = build_experience(
                batch.ids,
                batch.samples,
                batch.rewards,
                pad_id=self.tokenizer.pad_token_id,
                normalize_std=grpo.normalize_std,
                std=grpo.std,
                drop_zero_variance=grpo.drop_zero_variance,
                multiple_of=2 * recipe.parallel.cp,
            )
            exp.report.update(batch.report)
        schedule.start_next(step)  # the engines start the next step's rollouts (async)
        exp = ctx.broadcast(exp)
        started_update = time.perf_counter()
        policy = self.policy
        policy.set_lr(step)
        updates = grpo_update(
            policy.chunks, policy.ref_chunks, policy.optimizer, self.step_settings, ctx, exp
        )
        timings["time/train"] = time.perf_counter() - started_update
        schedule.finish_next(step)
        if schedule.refit_due(step + 1, also=refit_before):
            timings["time/sync"] = self.rollouts.sync(policy, step + 1)
        if not ctx.is_main:
            return {}
        timings = {**schedule.timings, **timings, **schedule.step_report(batch, busy_before)}
        timings["time/step"] = time.perf_counter() - started
        return step_record(step, exp, updates, policy.lr, timings, recipe.loss.scope)

    # -- the loop -------------------------------------------------------------------------
    def run(self, progress_stream=None) -> dict:
        """Train from `start_step` to `grpo.steps`; the summary (rank 0; {} elsewhere)."""
        recipe, ctx = self.recipe, self.ctx
        steps = recipe.grpo.steps
        last_eval = {}
        if self.start_step == 0:
            last_eval = self.evaluate(0)
            if ctx.is_main:
                self.folder.record({"step": 0, **last_eval})
                acc = last_eval["eval_accuracy"]
                self.log(f"[eval] step 0 (warm start): Acc@{recipe.eval.samples} {acc:.3f}")
        progress = None
        if ctx.is_main and recipe.logging.progress:
            from tqdm import tqdm

            progress = tqdm(
                total=steps, initial=self.start_step, desc="grpo", unit="step", file=progress_stream
            )
        every = recipe.checkpoint.every
        for step in range(self.start_step, steps):
            done = step + 1
            evaluate = done == steps or (recipe.eval.every and done % recipe.eval.every == 0)
            saves = done == steps or (every and done % every == 0)
            record = self.train_step(step, refit_before=bool(evaluate or saves))
            if evaluate:
                last_eval = self.evaluate(done)
                record.update(last_eval)
            if ctx.is_main:
                self.folder.record(record)
                if progress is not None:
                    post = {"reward": f"{record['reward_mean']:.3f}"}
                    if "eval_accuracy" in last_eval:
                        post["eval"] = f"{last_eval['eval_accuracy']:.3f}"
                    progress.set_postfix(post)
                    progress.update(1)
            if saves:
                self._checkpoint(done)
            # [preemption hook 2/2] asked to stop (SIGUSR1 / RUN_DIR/PREEMPT): checkpoint, raise
            if done < steps and preemption.should_stop(ctx, self.run_dir):
                preemption.stop(self, done)
        if progress is not None:
            progress.close()
        self.policy.export_hf(self.run_dir / "hf", self.tokenizer)  # the last step (collective)
        if not ctx.is_main:
            return {}
        summary = self.folder.finish()
        if recipe.logging.plots:
            plot_run(self.run_dir)
        return summary

    def _checkpoint(self, step: int) -> None:
        # Sharded model + optimiser and per-rank RNG; no Hugging Face export here (that is the
        # end of the run's RUN_DIR/hf/, or `megatron-ba convert CKPT OUT --to hf` on demand).
        # The engines hold this step's weights (refit_due), as a resumed run's will.
        schedule = self.schedule
        meta = {"data_position": schedule.data_position, "recipe": self.recipe.to_dict()}
        policy = self.policy
        checkpoint.save(
            self.ctx,
            self.run_dir,
            step,
            policy.chunks,
            policy.optimizer,
            meta,
            spec=policy.spec,
            source_dir=policy.source,
            pending=schedule.pending_state() if self.ctx.is_main else None,
        )
        if self.ctx.is_main:
            checkpoint.prune(self.run_dir, self.recipe.checkpoint.keep)

    def close(self) -> None:
        if self.ctx.is_main:
            self.folder.tracking.close()  # also on a preemption or an error: what was logged stays
        if self.scorer is not None:
            self.scorer.close()
        if self.rollouts is not None:
            self.rollouts.close()  # before teardown: an in-process engine tears down its groups
        teardown()


def step_record(step: int, exp, updates: dict, lr: float, timings: dict, scope: str) -> dict:
    """One metrics.jsonl line: rewards, the update's losses, the paper's diagnostics, timings."""

    diag = batch_diagnostics(exp.lengths, exp.advantages.double(), exp.group_ids, scope=scope)
    return {
        "step": step + 1,
        "reward_mean": float(exp.rewards.mean()),
        "accuracy": float((exp.rewards > 0.5).float().mean()),
        **updates,
        "lr": lr,
        "truncated_fraction": float((~exp.finished).float().mean()),
        **{k: v for k, v in diag.items() if not k.startswith("num_")},
        "num_pos": diag["num_pos"],
        "num_neg": diag["num_neg"],
        **exp.report,
        **timings,
        "rollout_tokens": int(exp.lengths.sum()),
    }
