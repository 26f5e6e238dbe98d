"""The local GRPO driver: megatron-core policy, vLLM rollouts, verifiable rewards, the BA plan.

    megatron-ba train recipes/tiny-cpu.yaml [key=value ...] [--run-dir DIR] [--resume DIR]
    torchrun --nproc-per-node 2 -m megatron_ba.cli train recipes/tiny-cpu-tp2.yaml

One step: rank 0 samples G responses for each of P prompts with vLLM and scores them; every rank
receives the batch, takes its data-parallel rows, computes the old log-probs (forward only) and
runs the GRPO loss through megatron-core's schedule (the plan's statistics all-reduced once over
DP), then the optimiser steps and the new weights are synced into vLLM. Evaluation (Acc@k at the
sampling temperature on held-out prompts) runs at step 0 (the warm-start policy), every
`eval.every` steps and at the end; checkpoints every `checkpoint.every` steps.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import torch

from megatron_ba.diagnostics import batch_diagnostics
from megatron_ba.recipe import Recipe
from megatron_ba.tasks.arithmetic import answer_of
from megatron_ba.train import checkpoint, preemption  # [preemption hook 1/2]
from megatron_ba.train.experience import build_experience
from megatron_ba.train.run_log import MetricsLog
from megatron_ba.train.update import grpo_update


def _seed_for(seed: int, step: int, purpose: str) -> int:
    h = hashlib.sha256(f"{seed}:{step}:{purpose}".encode()).digest()
    return int.from_bytes(h[:4], "big")


class Trainer:
    """State of one run on this rank. `run()` trains to the recipe's last step."""

    def __init__(self, recipe: Recipe, run_dir: Path, *, resume: bool, cache_dir: Path, log=print):
        from megatron_ba.train.distributed import setup

        self.recipe, self.run_dir, self.log = recipe, Path(run_dir), log
        p = recipe.parallel
        self.ctx = setup(tp=p.tp, pp=p.pp, cp=p.cp, seed=recipe.seed)
        if recipe.rollout.threads:
            torch.set_num_threads(recipe.rollout.threads)
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        if self.ctx.is_main:
            self._prepare_run_dir(resume)
        self.ctx.barrier()
        self._build(resume, cache_dir)

    # -- set-up ---------------------------------------------------------------------------
    def _prepare_run_dir(self, resume: bool) -> None:
        if not resume and self.metrics.path.is_file():
            raise FileExistsError(
                f"--run-dir: {self.run_dir} already holds a run; pass --resume {self.run_dir} "
                f"to continue it, or choose another --run-dir"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.recipe.dump(self.run_dir / "recipe.yaml")

    def _build(self, resume: bool, cache_dir: Path) -> None:
        from safetensors.torch import load_file

        from megatron_ba.megatron.model import build_model_chunks, load_full_state_dict
        from megatron_ba.megatron.optimizer import ShardedAdamW
        from megatron_ba.train.hf_convert import hf_to_megatron
        from megatron_ba.train.tokenizer import load_tokenizer
        from megatron_ba.train.warmstart import run_warmstart, task_of

        r, ctx = self.recipe, self.ctx
        hf_dir = ctx.broadcast(
            str(run_warmstart(r, cache_dir, log=self.log)) if ctx.is_main else None
        )
        self.hf_dir = Path(hf_dir)
        self.task = task_of(r)
        self.tokenizer = load_tokenizer(self.hf_dir)
        m = r.model
        self.spec = m.qwen2_spec(len(self.tokenizer))
        self.chunks = build_model_chunks(self.spec)
        hf = load_file(str(self.hf_dir / "model.safetensors"))
        start = hf_to_megatron(
            hf, num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups
        )
        load_full_state_dict(self.chunks, start)
        # The reference policy of the KL term: the starting (warm-start) weights, frozen.
        self.ref_chunks = None
        if r.loss.kl_coef > 0:
            self.ref_chunks = build_model_chunks(self.spec, ddp=False)
            load_full_state_dict(self.ref_chunks, start)
            for c in self.ref_chunks:
                c.requires_grad_(False)
        o = r.optimizer
        self.optimizer = ShardedAdamW(
            self.chunks,
            lr=o.lr,
            weight_decay=o.weight_decay,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            clip_grad=o.grad_clip,
        )
        self.start_step = 0
        if resume:
            ckpt = checkpoint.latest_dir(self.run_dir)
            if ckpt is None:
                raise FileNotFoundError(f"--resume: no complete checkpoint in {self.run_dir}")
            meta = checkpoint.load(ctx, ckpt, self.chunks, self.optimizer)
            self.start_step = meta["step"]
            if ctx.is_main:
                self.metrics.truncate_after(self.start_step)
                self.log(f"[resume] from {ckpt} (step {self.start_step})")
        self.engine = None
        self.rewards = None
        if ctx.is_main:
            self._start_engine()
            from megatron_ba.rewards import MathRewardPool

            self.rewards = MathRewardPool(workers=1, timeout_s=5.0)
        if resume:
            self._sync_weights()

    def _start_engine(self) -> None:
        r = self.recipe
        max_len = r.model.max_position_embeddings
        if r.rollout.engine == "vllm":
            from megatron_ba.train.rollout import VLLMEngine

            if r.rollout.in_process and self.ctx.world > 1:
                raise ValueError(
                    "rollout.in_process: vLLM can share the trainer's process only when the "
                    "world is one process (it would join the trainer's process groups)"
                )
            self.engine = VLLMEngine(
                str(self.hf_dir),
                sync_dir=str(self.run_dir / ".weights"),
                in_process=r.rollout.in_process,
                max_model_len=max_len,
                seed=r.seed,
                kv_cache_gb=r.rollout.kv_cache_gb,
                threads=r.rollout.threads,
            )
        else:
            if self.ctx.world != 1:
                raise ValueError("rollout.engine: 'builtin' runs in single-process runs only")
            from megatron_ba.train.rollout import BuiltinSampler

            self.engine = BuiltinSampler(
                self._full_vocab_forward,
                eos_token_id=self.tokenizer.eos_token_id,
                pad_token_id=self.tokenizer.pad_token_id,
                decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            )

    @torch.no_grad()
    def _full_vocab_forward(self, tokens, position_ids, attention_mask):
        model = self.chunks[0]
        model.eval()
        out = model(tokens, position_ids, attention_mask)
        model.train()
        return out

    # -- pieces of a step -----------------------------------------------------------------
    def _sync_weights(self) -> float:
        """Gather the policy (collective) and load it into vLLM (rank 0)."""
        from megatron_ba.megatron.model import gather_full_state_dict
        from megatron_ba.train.hf_convert import megatron_to_hf

        t = time.perf_counter()
        full = gather_full_state_dict(self.chunks)
        if self.ctx.is_main and hasattr(self.engine, "load_weights"):
            m = self.recipe.model
            self.engine.load_weights(
                megatron_to_hf(
                    full,
                    num_attention_heads=m.num_attention_heads,
                    num_query_groups=m.num_query_groups,
                )
            )
        return time.perf_counter() - t

    def _export_hf(self, out_dir: Path) -> None:
        from megatron_ba.megatron.model import gather_full_state_dict
        from megatron_ba.train.hf_convert import save_hf_model

        full = gather_full_state_dict(self.chunks)
        if self.ctx.is_main:
            save_hf_model(out_dir, full, self.spec, self.tokenizer)

    def _generate(self, prompts: list[str], n: int, temperature: float, seed: int):
        ids = [self.tokenizer(p)["input_ids"] for p in prompts]
        samples = self.engine.generate(
            ids, n=n, temperature=temperature, max_tokens=self.recipe.grpo.max_new_tokens, seed=seed
        )
        return ids, samples

    def _score(self, prompts: list[str], samples) -> list[float]:
        responses = [s.text for group in samples for s in group]
        truths = [
            str(answer_of(p)) for p, group in zip(prompts, samples, strict=True) for _ in group
        ]
        return self.rewards.score(responses, truths).scores

    def evaluate(self, step: int) -> dict:
        """Acc@k on the held-out prompts at the eval temperature (rank 0; {} elsewhere)."""
        if not self.ctx.is_main:
            return {}
        from megatron_ba.evaluation.metrics import acc_at_k, best_at_k

        e = self.recipe.eval
        t = time.perf_counter()
        prompts = self.task.prompts("eval", self.recipe.data.eval_prompts)
        _, samples = self._generate(
            prompts, e.samples, e.temperature, _seed_for(self.recipe.seed, step, "eval")
        )
        scores = self._score(prompts, samples)
        k = e.samples
        correct = [[s > 0.5 for s in scores[i * k : (i + 1) * k]] for i in range(len(prompts))]
        return {
            "eval_accuracy": acc_at_k(correct),
            "eval_best_at_k": best_at_k(correct),
            "eval_k": k,
            "time/eval": time.perf_counter() - t,
        }

    def train_step(self, step: int) -> dict:
        r, ctx = self.recipe, self.ctx
        g = r.grpo
        timings: dict[str, float] = {}
        exp = None
        if ctx.is_main:
            t = time.perf_counter()
            prompts = self.task.prompts(
                "train", g.prompts_per_step, offset=step * g.prompts_per_step
            )
            ids, samples = self._generate(
                prompts, g.group_size, g.temperature, _seed_for(r.seed, step, "rollout")
            )
            timings["time/rollout"] = time.perf_counter() - t
            t = time.perf_counter()
            rewards = self._score(prompts, samples)
            timings["time/reward"] = time.perf_counter() - t
            self._log_samples(step + 1, prompts, samples, rewards)
            exp = build_experience(
                ids,
                samples,
                rewards,
                pad_id=self.tokenizer.pad_token_id,
                normalize_std=g.normalize_std,
                std=g.std,
                drop_zero_variance=g.drop_zero_variance,
                multiple_of=2 * r.parallel.cp,
            )
        exp = ctx.broadcast(exp)
        t = time.perf_counter()
        self._set_lr(step)
        updates = grpo_update(self.chunks, self.ref_chunks, self.optimizer, r, ctx, exp)
        timings["time/train"] = time.perf_counter() - t
        timings["time/sync"] = self._sync_weights()
        if not ctx.is_main:
            return {}
        diag = batch_diagnostics(
            exp.lengths, exp.advantages.double(), exp.group_ids, scope=r.loss.scope
        )
        record = {
            "step": step + 1,
            "reward_mean": float(exp.rewards.mean()),
            "accuracy": float((exp.rewards > 0.5).float().mean()),
            **updates,
            "lr": self.optimizer.optimizer.param_groups[0]["lr"],
            "truncated_fraction": float((~exp.finished).float().mean()),
            **{k: v for k, v in diag.items() if not k.startswith("num_")},
            "num_pos": diag["num_pos"],
            "num_neg": diag["num_neg"],
            **exp.report,
            **timings,
            "rollout_tokens": int(exp.lengths.sum()),
        }
        return record

    def _log_samples(self, step: int, prompts, samples, rewards, per_step: int = 2) -> None:
        """A few rollouts per step in samples.jsonl: what the policy writes, and its reward."""
        G = len(samples[0])
        with (self.run_dir / "samples.jsonl").open("a") as f:
            for i in range(min(per_step, len(prompts))):
                for j in (0, 1):
                    s = samples[i][j]
                    rec = {
                        "step": step,
                        "prompt": prompts[i],
                        "response": s.text,
                        "tokens": len(s.token_ids),
                        "reward": rewards[i * G + j],
                    }
                    f.write(json.dumps(rec) + "\n")

    def _set_lr(self, step: int) -> None:
        o = self.recipe.optimizer
        scale = min(1.0, (step + 1) / o.warmup_steps) if o.warmup_steps > 0 else 1.0
        for group in self.optimizer.optimizer.param_groups:
            group["lr"] = o.lr * scale

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> dict:
        r, ctx = self.recipe, self.ctx
        steps = r.grpo.steps
        progress = None
        if ctx.is_main and r.logging.progress:
            from tqdm import tqdm

            progress = tqdm(total=steps, initial=self.start_step, desc="grpo", unit="step")
        last_eval = {}
        if self.start_step == 0:
            last_eval = self.evaluate(0)
            if ctx.is_main:
                self.metrics.append({"step": 0, **last_eval})
                acc = last_eval["eval_accuracy"]
                self.log(f"[eval] step 0 (warm start): Acc@{r.eval.samples} {acc:.3f}")
        for step in range(self.start_step, steps):
            record = self.train_step(step)
            done = step + 1
            if done == steps or (r.eval.every and done % r.eval.every == 0):
                last_eval = self.evaluate(done)
                record.update(last_eval)
            if ctx.is_main:
                self.metrics.append(record)
                if progress is not None:
                    post = {"reward": f"{record['reward_mean']:.3f}"}
                    if "eval_accuracy" in last_eval:
                        post["eval"] = f"{last_eval['eval_accuracy']:.3f}"
                    progress.set_postfix(post)
                    progress.update(1)
            every = r.checkpoint.every
            if done == steps or (every and done % every == 0):
                self._checkpoint(done)
            # [preemption hook 2/2] asked to stop (SIGUSR1 / RUN_DIR/PREEMPT): checkpoint, raise
            if done < steps and preemption.should_stop(ctx, self.run_dir):
                preemption.stop(self, done)
        if progress is not None:
            progress.close()
        summary = {}
        if ctx.is_main:
            summary = summarize(self.metrics.read())
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            if r.logging.plots:
                from megatron_ba.train.plots import plot_run

                plot_run(self.run_dir)
        return summary

    def _checkpoint(self, step: int) -> None:
        meta = {
            "layout": {"tp": self.ctx.tp, "pp": self.ctx.pp, "cp": self.ctx.cp, "dp": self.ctx.dp},
            "data_position": step * self.recipe.grpo.prompts_per_step,
            "recipe": self.recipe.to_dict(),
        }
        checkpoint.save(
            self.ctx, self.run_dir, step, self.chunks, self.optimizer, meta, self._export_hf
        )
        if self.ctx.is_main:
            checkpoint.prune(self.run_dir, self.recipe.checkpoint.keep)

    def close(self) -> None:
        from megatron_ba.train.distributed import teardown

        if self.rewards is not None:
            self.rewards.close()
        if hasattr(self.engine, "close"):
            self.engine.close()  # before teardown: an in-process engine tears down its groups
        teardown()


def summarize(records: list[dict]) -> dict:
    """Peak and last held-out accuracy, the step-0 baseline, and the time spent."""
    evals = [(r["step"], r["eval_accuracy"]) for r in records if r.get("eval_accuracy") is not None]
    out: dict = {"steps": max((r["step"] for r in records), default=0)}
    if evals:
        peak = max(evals, key=lambda e: e[1])
        out.update(
            eval_accuracy_start=evals[0][1],
            eval_accuracy_peak=peak[1],
            eval_accuracy_peak_step=peak[0],
            eval_accuracy_last=evals[-1][1],
            eval_gain_last=evals[-1][1] - evals[0][1],
        )
    times = {}
    for r in records:
        for k, v in r.items():
            if k.startswith("time/") and isinstance(v, int | float):
                times[k] = times.get(k, 0.0) + v
    out["seconds"] = {k: round(v, 2) for k, v in times.items()}
    pg = [r["pg_loss"] for r in records if isinstance(r.get("pg_loss"), int | float)]
    out["pg_loss_mean_abs"] = sum(abs(x) for x in pg) / len(pg) if pg else math.nan
    return out
