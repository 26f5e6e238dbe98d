"""Supervised warm start of the tiny CPU policy, cached by the hash of everything it depends on.

GRPO needs a policy that is right some of the time. The warm start trains a fresh Qwen2-shaped
model (transformers, plain torch: it is a preparation step, the GRPO policy itself runs on
megatron-core) on the task's mixture of correct and sloppy solutions, then saves it as a Hugging
Face model directory that both vLLM and the megatron policy load. The result is cached under
`<cache>/warmstart-<hash>/` so that runs of one recipe (the rules of `megatron-ba compare`, a
resumed run, and by default every clone on the machine: train.warmstart_cache) share it; the hash
covers the task, tokenizer, model shape, warm-start settings and seed, the torch and transformers
releases, and the source of the procedure (this module, the task, the tokenizer), so a checkout
on another commit never takes a warm start its code would not make.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch

from megatron_ba.conversion import hf_config_from_spec
from megatron_ba.megatron.model import ModelSpec
from megatron_ba.recipe import Recipe
from megatron_ba.tasks import build_task
from megatron_ba.tasks.arithmetic import ArithmeticTask
from megatron_ba.tokenization import EOS, load_tokenizer, train_tokenizer

WARMSTART_VERSION = 1  # bump when the procedure changes, to invalidate caches


def task_of(recipe: Recipe) -> ArithmeticTask:
    """The synthetic task the warm start trains on (the warm start exists for it alone)."""

    if recipe.data.task != "arithmetic":
        raise ValueError(f"warmstart: trains the arithmetic task only, not {recipe.data.task!r}")
    return build_task(recipe)


def warmstart_seed(recipe: Recipe) -> int:
    """The warm start's seed: warmstart.seed, else the run's."""
    return recipe.seed if recipe.warmstart.seed is None else recipe.warmstart.seed


# The model keys a dense recipe's cache key has always held (the MoE keys joined later).
_DENSE = frozenset(
    "pretrained hidden_size num_layers num_attention_heads num_query_groups ffn_hidden_size "
    "max_position_embeddings rope_theta norm_eps rope_scaling init_std precision "
    "transformer_impl attention".split()
)


# The modules whose code decides the warm start beyond the recipe's keys.
_PROCEDURE = ("train/warmstart.py", "tasks/arithmetic.py", "tokenization.py")


def _procedure_hash() -> str:
    import transformers

    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(f"{torch.__version__} {transformers.__version__}".encode())
    for name in _PROCEDURE:
        digest.update((root / name).read_bytes())
    return digest.hexdigest()[:16]


def cache_key(recipe: Recipe) -> str:
    parts = {
        "version": WARMSTART_VERSION,
        "procedure": _procedure_hash(),
        "seed": warmstart_seed(recipe),
        # the mixture-of-experts keys only when set: a dense recipe keeps its cached warm start
        "model": {k: v for k, v in recipe.model.__dict__.items() if v is not None or k in _DENSE},
        "tokenizer": recipe.tokenizer.__dict__,
        "data": {k: v for k, v in recipe.data.__dict__.items() if k != "eval_prompts"},
        "warmstart": {k: v for k, v in recipe.warmstart.__dict__.items() if k != "seed"},
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _hf_model(recipe: Recipe, vocab_size: int, eos_id: int):
    """A fresh transformers model with the policy's exact shape (one config source): Qwen2, or
    Qwen3-MoE when the recipe sets model.num_experts (the "tiny-moe" preset's family: q/k norms,
    no QKV bias; untied, as the dense policy)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # The one source of both the megatron-core policy and its Hugging Face twin (warm start,
    # vLLM, exports): the recipe's shape keys.
    spec = ModelSpec.of(recipe.model.fresh_shape(vocab_size), init_std=recipe.model.init_std)
    cfg = hf_config_from_spec(spec, eos_token_id=eos_id, bos_token_id=eos_id)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))


def _batches(examples, tokenizer, batch_size: int, rng: torch.Generator):
    """Endless shuffled batches: input ids, labels (-100 on prompt and padding)."""
    encoded = []
    for prompt, response in examples:
        p = tokenizer(prompt)["input_ids"]
        r = tokenizer(response)["input_ids"] + [tokenizer.eos_token_id]
        encoded.append((p, r))
    while True:
        for idx in torch.randperm(len(encoded), generator=rng).split(batch_size):
            rows = [encoded[i] for i in idx.tolist()]
            width = max(len(p) + len(r) for p, r in rows)
            ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
            labels = torch.full((len(rows), width), -100, dtype=torch.long)
            attn = torch.zeros((len(rows), width), dtype=torch.long)
            for i, (p, r) in enumerate(rows):
                seq = torch.tensor(p + r)
                ids[i, : len(seq)] = seq
                labels[i, len(p) : len(seq)] = torch.tensor(r)
                attn[i, : len(seq)] = 1
            yield ids, labels, attn


def run_warmstart(recipe: Recipe, cache_dir: str | Path, log=print) -> Path:
    """The warm-started HF model directory for `recipe` (trained now, or found in the cache).
    Runs that share the cache (every clone on a machine, a study's side-by-side elements) train
    one warm start between them: the first takes the entry's lock and trains, the others wait for
    it and take its result; none replaces a directory another run may be reading."""
    cache_dir = Path(cache_dir)
    out = cache_dir / f"warmstart-{cache_key(recipe)}"
    if (out / "DONE").is_file():
        log(f"[warmstart] cached: {out}")
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(cache_dir / f".{out.name}.lock", log):
        if (out / "DONE").is_file():
            log(f"[warmstart] cached (trained by another run meanwhile): {out}")
            return out
        return _train(recipe, out, log)


@contextlib.contextmanager
def _exclusive(lock_path: Path, log):
    """An exclusive lock on `lock_path` (flock: released when its holder exits, even killed)."""
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"[warmstart] another run is training this warm start; waiting ({lock_path})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _train(recipe: Recipe, out: Path, log) -> Path:
    """Train the warm start into a scratch folder beside `out`, then move it into place."""
    cache_dir = out.parent
    task = task_of(recipe)
    tmp = cache_dir / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = train_tokenizer(task.corpus(), recipe.tokenizer.vocab_size, tmp)
    tokenizer = load_tokenizer(tmp)
    torch.manual_seed(warmstart_seed(recipe))
    model = _hf_model(recipe, len(tokenizer), tokenizer.eos_token_id)
    ws = recipe.warmstart
    examples = task.warmstart_examples(
        max(ws.steps * ws.batch_size // 4, 1024), ws.correct_fraction
    )
    rng = torch.Generator().manual_seed(warmstart_seed(recipe))
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, ws.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup)
            * 0.5
            * (1 + math.cos(math.pi * min(s, ws.steps) / max(ws.steps, 1)))
        ),
    )
    batches = _batches(examples, tokenizer, ws.batch_size, rng)
    t0 = time.perf_counter()
    model.train()
    for step in range(ws.steps):
        ids, labels, attn = next(batches)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % max(1, ws.steps // 10) == 0 or step == ws.steps - 1:
            log(f"[warmstart] step {step + 1}/{ws.steps} loss {loss.item():.4f}")
    model.eval()
    model.save_pretrained(tmp, safe_serialization=True)
    gen = {"eos_token_id": tokenizer.eos_token_id, "do_sample": True, "temperature": 1.0}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    info = {"seconds": time.perf_counter() - t0, "examples": len(examples), "eos": EOS}
    (tmp / "warmstart.json").write_text(json.dumps(info, indent=2))
    (tmp / "DONE").write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)  # atomic: a cache entry is whole or absent
    log(f"[warmstart] trained in {info['seconds']:.0f} s -> {out}")
    return out
