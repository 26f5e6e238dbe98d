"""Benchmark: HF -> megatron-core conversion speed and peak host memory (docs/performance.md).

    megatron-ba perf conversion                       # Qwen2.5-0.5B shape, 24 layers, bfloat16
    megatron-ba perf conversion --layers 6 --dtype float32 --keep /tmp/ck

A random checkpoint of Qwen2.5-0.5B's shape (hidden 896, 14 heads, 2 kv groups, ffn 4864,
vocab 151936, tied embeddings, QKV bias) is built with transformers and saved with
save_pretrained (in a child process, so its memory does not count). A fresh child process then
imports megatron-core, initialises a world of one (TP=1, PP=1), builds the GPTModel in the
checkpoint's dtype without random initialisation, and streams the checkpoint into it
(`megatron_ba.conversion.load_hf_into_chunks`), timed. Reported: seconds per billion parameters
of the load, and the process's resident-memory high-water mark (VmHWM of /proc/self/status)
against the checkpoint's size on disk, both in total and above the resident size just before
the model is built (imports, interpreter). The goal is a total <= 1.5 x the checkpoint: the
model itself is 1 x; streaming by tensor adds at most the largest fused tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_ba.conversion import (
    HFCheckpoint,
    hf_config_from_spec,
    load_hf_into_chunks,
    spec_from_hf_dir,
)
from megatron_ba.megatron import model as mm
from megatron_ba.megatron.startup import setup, teardown
from megatron_ba.model_shape import PRESETS
from megatron_ba.parallel.parallel_layout import ParallelLayout

QWEN = PRESETS["qwen2.5-0.5b"]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def build(out: str, layers: int, dtype: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.set_default_dtype(getattr(torch, dtype))  # no float32 copy of a bfloat16 model
    torch.manual_seed(0)
    # The preset's config.json as the exporter writes it (but the layer count, an option here).
    spec = mm.ModelSpec.of(QWEN, num_layers=layers, params_dtype=getattr(torch, dtype))
    model = Qwen2ForCausalLM(Qwen2Config.from_dict(hf_config_from_spec(spec)))
    model.save_pretrained(out)


def measure(src: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore")

    setup(ParallelLayout(dp=None), seed=0)
    spec = spec_from_hf_dir(src)
    rss_before = _status_kib("VmRSS")
    t = time.perf_counter()
    config = mm.transformer_config(spec, perform_initialization=False)
    chunks = mm.build_model_chunks(spec, ddp=False, config=config)
    built = time.perf_counter() - t
    t = time.perf_counter()
    load_hf_into_chunks(chunks, src, spec)
    load = time.perf_counter() - t
    peak = _status_kib("VmHWM") * 1024
    teardown()
    params = spec.num_parameters()
    ckpt = HFCheckpoint(src).total_bytes()
    return {
        "parameters": params,
        "dtype": str(spec.params_dtype).split(".")[-1],
        "checkpoint_bytes": ckpt,
        "build_seconds": round(built, 2),
        "load_seconds": round(load, 2),
        "load_seconds_per_billion_parameters": round(load / (params / 1e9), 2),
        "peak_rss_bytes": peak,
        "rss_before_build_bytes": rss_before * 1024,
        "peak_rss_over_checkpoint": round(peak / ckpt, 3),
        "peak_rss_above_baseline_over_checkpoint": round((peak - rss_before * 1024) / ckpt, 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megatron-ba perf conversion", description=__doc__)
    p.add_argument("--layers", type=int, default=24, help="decoder layers (Qwen2.5-0.5B: 24)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--keep", help="build the checkpoint here and keep it (default: a temp dir)")
    p.add_argument("--_build", help=argparse.SUPPRESS)
    p.add_argument("--_measure", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._build:
        build(args._build, args.layers, args.dtype)
        return 0
    if args._measure:
        print("RESULT " + json.dumps(measure(args._measure)))
        return 0
    here = [sys.executable, str(Path(__file__).resolve())]
    checkout = str(Path(__file__).resolve().parents[1])  # this checkout's megatron_ba wins
    env = dict(os.environ, PYTHONPATH=checkout + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory(prefix="bench-conversion-") as tmp:
        src = args.keep or str(Path(tmp) / "qwen2.5-0.5b-shape")
        if not (Path(src) / "config.json").is_file():
            t = time.perf_counter()
            b = [*here, "--_build", src, "--layers", str(args.layers), "--dtype", args.dtype]
            subprocess.run(b, check=True, capture_output=True, env=env)
            print(f"built {src} in {time.perf_counter() - t:.1f} s")
        proc = subprocess.run(
            [*here, "--_measure", src], check=True, capture_output=True, text=True, env=env
        )
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
        result = json.loads(line[len("RESULT ") :])
    result["layers"] = args.layers
    for k, v in result.items():
        print(f"{k:>42}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
