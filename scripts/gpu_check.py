"""The single-GPU check of issue 10: each stage a subprocess with its own timeout, figures in JSON.

    python scripts/gpu_check.py --out gpu_check.json      # normally via scripts/gpu_check.sh
    GPU_CHECK_ALLOW_CPU=1 python scripts/gpu_check.py --out /tmp/g.json   # CPU dry run, tiny sizes

Stages (each "pass", "fail" or "skipped", with its command, seconds, exit status, figures and the
tail of its output; the file is rewritten after every stage, so a kill leaves what was done):
  env            torch / CUDA / GPU / Transformer Engine / vLLM / megatron-core versions, pip check
  train          `megatron-ba train recipes/tiny-cpu.yaml` in bf16 (model.precision=bf16,
                 model.transformer_impl=auto, rollout.engine=builtin without vLLM), 2 GRPO steps
  check_layout   `megatron-ba check-layout --dp 1 --micro-batches 2`: the BA plan exact at DP=1
  vocab_parallel `megatron-ba bench vocab-parallel --device cuda` at T=16,384: time, peak vs naive
  step           `megatron-ba bench step` BA vs token-mean, bf16 (goal: <= 1.02x)
  memory_7b      a 7B-width slice (Qwen2.5-Math-7B's layers, 2 of 28) at 1,024 + 16,384 tokens:
                 measured peak vs planning.memory's estimate of that slice, and the estimate of
                 the whole 7B step in the recipes' chosen layout (`megatron-ba layout ... --json`)

Without CUDA every stage but env is skipped unless GPU_CHECK_ALLOW_CPU=1, which runs them on the
CPU at tiny sizes in fp32 (the plumbing, not the figures), with CPU_BUDGET_SCALE times the time
budgets. On a GPU the stages' budgets add up to STAGE_BUDGET_S, so the whole check ends within
8 minutes with the install of gpu_check.sh.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "megatron_ba.cli"]
# Seconds per stage; their sum (STAGE_BUDGET_S, 410) + gpu_check.sh's 50 s install < 8 min.
BUDGET = {
    "env": 25,
    "train": 100,
    "check_layout": 70,
    "vocab_parallel": 75,
    "step": 75,
    "memory_7b": 65,
}
STAGE_BUDGET_S = sum(BUDGET.values())
# The CPU dry run proves the plumbing on a (possibly shared) CPU machine, where the 8 minutes do not
# apply: its budgets are this many times the GPU's.
CPU_BUDGET_SCALE = 4
NEW_KEYS = ("model.precision", "model.transformer_impl")  # issue 10's keys (devices helper)
# Qwen2.5-Math-7B's shape (planning.memory.PRESETS) for the bench's overrides; 2 of its 28 layers.
SLICE_LAYERS = 2
QWEN25_MATH_7B = dict(hidden=3584, heads=28, query_groups=4, ffn=18944, vocab=152064)
PROMPT, RESPONSE = 1024, 16384
# The recipes' layout at 16K: the planner's proposal for recipes/qwen2.5-math-7b-*.yaml's cluster
# (1 node x 8 GPUs of 80 GiB, G = 16, 128 prompts per step), response length 16,384.
LAYOUT_CMD = (
    "layout --model qwen2.5-math-7b --nodes 1 --gpus-per-node 8 --gpu-mem 80 "
    f"--max-response-len {RESPONSE} --prompt-len {PROMPT} --group-size 16 "
    "--prompts-per-step 128 --json"
).split()


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _importable(module: str) -> str | None:
    """None if `module` imports, else the error (a broken install reads differently from none)."""
    try:
        importlib.import_module(module)
    except Exception as e:  # an ImportError, or a CUDA/ABI mismatch raised at import
        return f"{type(e).__name__}: {e}"[:300]
    return None


def env_report() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": cuda,
        "gpu_name": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        "gpu_memory_gib": (
            torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None
        ),
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "bf16_supported": bool(cuda and torch.cuda.is_bf16_supported()),
    }
    for dist in (
        "megatron-core",
        "transformer-engine",
        "transformer_engine_torch",
        "vllm",
        "flash-attn",
        "transformers",
        "safetensors",
        "math-verify",
        "numpy",
    ):
        out[dist.replace("-", "_")] = _version(dist)
    out["transformer_engine_import_error"] = _importable("transformer_engine.pytorch")
    out["vllm_import_error"] = _importable("vllm") if out["vllm"] else "not installed"
    out["megatron_ba_import_error"] = _importable("megatron_ba.megatron.grpo_step")
    check = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=20
    )
    out["pip_check"] = (check.stdout + check.stderr).strip().splitlines()[-20:]
    return out


class Check:
    def __init__(self, out: Path, cpu_dry_run: bool, work: Path) -> None:
        self.out, self.work = out, work
        self.set_mode(cpu_dry_run)
        self.result: dict = {
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "mode": "cpu-dry-run" if cpu_dry_run else "cuda",
            "host": platform.node(),
            "stage_budget_s": dict(BUDGET),
            "stages": {},
            "figures": {},
        }

    def set_mode(self, cpu_dry_run: bool) -> None:
        self.cpu = cpu_dry_run
        self.scale = CPU_BUDGET_SCALE if cpu_dry_run else 1
        self.deadline = time.monotonic() + STAGE_BUDGET_S * self.scale

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        tmp.replace(self.out)

    def record(self, name: str, **fields) -> dict:
        stage = self.result["stages"].setdefault(name, {})
        stage.update(fields)
        self.save()
        return stage

    def run(self, name: str, cmd: list[str], *, figures=None, env=None) -> dict:
        """Run one stage's command under its budget; figures(stdout) -> dict on exit 0."""
        timeout = max(1, min(BUDGET[name] * self.scale, int(self.deadline - time.monotonic())))
        shown = " ".join(c if c != sys.executable else "python" for c in cmd)
        t0 = time.monotonic()
        try:
            p = subprocess.run(
                cmd,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=timeout,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )
            rc, text = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc = 124
            text = (
                (e.stdout or b"").decode(errors="replace")
                if isinstance(e.stdout, bytes)
                else (e.stdout or "")
            ) + f"\n[timed out after {timeout} s]"
        seconds = round(time.monotonic() - t0, 2)
        stage = {
            "command": shown,
            "timeout_s": timeout,
            "seconds": seconds,
            "rc": rc,
            "output_tail": text[-3000:],
        }
        if rc == 0 and figures is not None:
            try:
                stage["figures"] = figures(text)
                stage["status"] = "pass"
            except Exception as e:  # the command ran but its figures are not there
                stage.update(status="fail", error=f"figures: {type(e).__name__}: {e}")
        elif rc == 0:
            stage["status"] = "pass"
        else:
            stage.update(status="fail", error=_why(text, rc))
        return self.record(name, **stage)

    def skip(self, name: str, why: str) -> None:
        self.record(name, status="skipped", error=why)


def _why(text: str, rc: int) -> str:
    """The clearest one-line reason a stage failed."""
    for key in NEW_KEYS:
        if key in text and re.search(r"unknown|not a key|no such key|unexpected", text, re.I):
            return f"recipe key {key} is not known to this checkout (issue 10 adds it); exit {rc}"
    if rc == 124:
        return "timed out"
    if "OutOfMemoryError" in text or "CUDA out of memory" in text:
        return f"CUDA out of memory; exit {rc}"
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"Error|error:|Exception", ln)]
    return f"exit {rc}: {(errors or lines or [''])[-1].strip()[:400]}"


def _json_file(path: Path):
    def read(_text: str) -> dict:
        return json.loads(path.read_text())

    return read


def stage_train(c: Check, vllm: bool) -> None:
    run_dir = c.work / "train"
    keys = [
        f"model.precision={'fp32' if c.cpu else 'bf16'}",
        "model.transformer_impl=auto",
        f"rollout.engine={'vllm' if vllm else 'builtin'}",
        "warmstart.steps=20",
        "grpo.steps=2",
        "grpo.prompts_per_step=4",
        "grpo.group_size=4",
        "grpo.max_new_tokens=16",
        "parallel.micro_batch_size=4",
        "eval.every=0",
        "checkpoint.every=0",
        "logging.plots=false",
    ]

    def figures(_text: str) -> dict:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
        if not rows:
            raise ValueError("metrics.jsonl is empty")
        last = rows[-1]
        return {
            "steps": len(rows),
            "last_step": {k: v for k, v in last.items() if isinstance(v, int | float)},
            "run_dir": str(run_dir),
        }

    cmd = [
        *CLI,
        "train",
        "recipes/tiny-cpu.yaml",
        *keys,
        "--run-dir",
        str(run_dir),
        "--cache-dir",
        str(c.work / "cache"),
    ]
    c.run("train", cmd, figures=figures)


def stage_check_layout(c: Check) -> None:
    def figures(text: str) -> dict:
        m = re.search(r"max_rel_grad_err=(\S+) loss_err=(\S+)", text)
        if not m:
            raise ValueError("no max_rel_grad_err line")
        return {"max_rel_grad_err": float(m.group(1)), "loss_err": float(m.group(2))}

    cmd = [
        *CLI,
        "check-layout",
        "--tp",
        "1",
        "--pp",
        "1",
        "--cp",
        "1",
        "--dp",
        "1",
        "--micro-batches",
        "2",
        "--rule",
        "balanced",
    ]
    c.run("check_layout", cmd, figures=figures)


def stage_vocab_parallel(c: Check, device: str) -> None:
    path = c.work / "vocab_parallel.json"
    size = (
        ["--tokens", "256", "--vocab", "4096", "--tp", "1", "--rounds", "1", "--chunk-sizes", "64"]
        if c.cpu
        else ["--tokens", "16384", "--rounds", "3", "--chunk-sizes", "256,1024"]
    )
    cmd = [*CLI, "bench", "vocab-parallel", "--device", device, *size, "--json", str(path)]

    def figures(_text: str) -> dict:
        d = json.loads(path.read_text())
        rows = {r["variant"]: r for r in d["rows"]}
        keep = (
            "peak_extra_mib",
            "memory_ratio",
            "median_s",
            "min_s",
            "time_ratio",
            "max_abs_diff_vs_naive",
        )
        return {
            "tokens": d["args"]["tokens"],
            "memory_kind": d["memory_kind"],
            "variants": {v: {k: r[k] for k in keep} for v, r in rows.items()},
        }

    c.run("vocab_parallel", cmd, figures=figures)


def _step_figures(path: Path):
    def read(_text: str) -> dict:
        d = json.loads(path.read_text())
        d.pop("args", None)
        return d

    return read


def stage_step(c: Check, device: str) -> None:
    path = c.work / "step.json"
    size = (
        [
            "--shape",
            "tiny",
            "--sequences",
            "8",
            "--group-size",
            "4",
            "--seq-len",
            "64",
            "--prompt-len",
            "16",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--threads",
            "2",
        ]
        if c.cpu
        else [
            "--shape",
            "small",
            "--sequences",
            "32",
            "--group-size",
            "8",
            "--seq-len",
            "2048",
            "--prompt-len",
            "256",
            "--micro-batches",
            "4",
            "--repeats",
            "5",
            "--warmup",
            "2",
            "--dtype",
            "bf16",
            "--logprob-chunk-size",
            "1024",
        ]
    )
    cmd = [*CLI, "bench", "step", "--device", device, *size, "--json", str(path)]
    c.run("step", cmd, figures=_step_figures(path))


def _slice_estimate(
    layers: int, tokens: int, chunk: int, recompute: bool, shape_name: str, overrides: dict
) -> dict:
    """planning.memory's estimate of the slice the bench measures (DP=1, no vLLM)."""
    from dataclasses import replace

    from megatron_ba.planning.memory import GIB, Layout, estimate, load_model

    shape = replace(load_model(shape_name), num_layers=layers, **overrides)
    est = estimate(
        shape,
        Layout(
            tp=1,
            pp=1,
            cp=1,
            dp=1,
            micro_batch_tokens=tokens,
            recompute=recompute,
            logprob_chunk=chunk,
        ),
        gpu_mem_gib=1e6,
        vllm=None,
    )
    return {
        "estimated_peak_gib": est.peak / GIB,
        "breakdown_gib": est.breakdown_gib(),
        "parameters": shape.total_params(),
    }


def stage_memory_7b(c: Check, device: str) -> None:
    path = c.work / "memory_7b.json"
    try:  # the planner's arithmetic: a second on any machine
        layout = subprocess.run(
            [*CLI, *LAYOUT_CMD], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        ok = layout.returncode == 0
        chosen = json.loads(layout.stdout) if ok else {"error": layout.stderr[-500:]}
    except subprocess.TimeoutExpired:
        chosen = {"error": "megatron-ba layout timed out (60 s)"}
    if c.cpu:  # the plumbing: a tiny 2-layer slice, no recompute (megatron-core's needs CUDA)
        tokens, chunk, recompute = 128, 64, False
        dims = dict(hidden=128, heads=4, query_groups=2, ffn=384, vocab=1024)
        est_overrides = dict(
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=384,
            vocab_size=1024,
        )
    else:
        tokens, chunk, recompute = PROMPT + RESPONSE, 1024, True
        dims, est_overrides = QWEN25_MATH_7B, {}
    args = [
        "--layers",
        str(SLICE_LAYERS),
        "--seq-len",
        str(tokens),
        "--prompt-len",
        str(tokens // 17 or 1),
        "--sequences",
        "2",
        "--group-size",
        "2",
        "--micro-batches",
        "2",
        "--repeats",
        "1",
        "--warmup",
        "1",
        "--logprob-chunk-size",
        str(chunk),
    ]
    for k, v in dims.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    if not c.cpu:
        args += ["--dtype", "bf16", "--recompute", "full"]
    slice_est = _slice_estimate(
        SLICE_LAYERS, tokens, chunk, recompute, "Qwen2.5-Math-7B", est_overrides
    )

    def figures(text: str) -> dict:
        d = _step_figures(path)(text)
        measured = max(d["ba_peak_mib"], d["token_mean_peak_mib"]) / 1024
        return {
            "slice_layers": SLICE_LAYERS,
            "tokens_per_microbatch": tokens,
            "measured_peak_gib": measured,
            "memory_kind": d["memory_kind"],
            "transformer_impl": d["transformer_impl"],
            "recompute": d["recompute"],
            "slice_estimate": slice_est,
            "measured_over_estimate": measured / slice_est["estimated_peak_gib"],
            "step": d,
        }

    c.record(
        "memory_7b",
        chosen_layout_estimate=chosen,
        chosen_layout_command="megatron-ba " + " ".join(LAYOUT_CMD),
    )
    cmd = [*CLI, "bench", "step", "--device", device, *args, "--json", str(path)]
    c.run("memory_7b", cmd, figures=figures)


def summarise(c: Check) -> None:
    """The headline figures, one level deep, for docs/performance.md."""
    s, f = c.result["stages"], c.result["figures"]
    step = s.get("step", {}).get("figures", {})
    for k in (
        "ratio_ba_over_token_mean",
        "paired_ratio_median",
        "ba_median_s",
        "token_mean_median_s",
        "ba_peak_mib",
        "token_mean_peak_mib",
        "transformer_impl",
        "parameters",
        "tokens_per_step",
    ):
        if k in step:
            f[f"step_{k}"] = step[k]
    vp = s.get("vocab_parallel", {}).get("figures", {}).get("variants", {})
    for v, row in vp.items():
        f[f"vocab_parallel_{v}_peak_extra_mib"] = row["peak_extra_mib"]
        f[f"vocab_parallel_{v}_median_s"] = row["median_s"]
    mem = s.get("memory_7b", {})
    if "figures" in mem:
        f["memory_7b_slice_measured_peak_gib"] = mem["figures"]["measured_peak_gib"]
        f["memory_7b_slice_estimated_peak_gib"] = mem["figures"]["slice_estimate"][
            "estimated_peak_gib"
        ]
    chosen = mem.get("chosen_layout_estimate", {})
    if isinstance(chosen, dict) and "memory_gib_per_gpu" in chosen:
        f["memory_7b_16k_chosen_layout_estimate_gib"] = chosen["memory_gib_per_gpu"]
    cl = s.get("check_layout", {}).get("figures", {})
    if cl:
        f["check_layout_max_rel_grad_err"] = cl["max_rel_grad_err"]
    f["stages_passed"] = sorted(k for k, v in s.items() if v.get("status") == "pass")
    f["stages_failed"] = sorted(k for k, v in s.items() if v.get("status") == "fail")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the JSON file of the figures")
    p.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    p.add_argument(
        "--stages",
        default=",".join(list(BUDGET)[1:]),
        help="comma-separated stages after env to run (default: all); the others are skipped",
    )
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-check-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    allow_cpu = os.environ.get("GPU_CHECK_ALLOW_CPU") == "1"
    c = Check(out, cpu_dry_run=False, work=work)
    t0 = time.monotonic()
    try:
        env = env_report()
        c.record("env", status="pass", seconds=round(time.monotonic() - t0, 2), figures=env)
    except Exception as e:
        c.record("env", status="fail", error=f"{type(e).__name__}: {e}")
        env = {"cuda_available": False, "vllm_import_error": "env failed"}
    cuda = bool(env.get("cuda_available"))
    if not cuda and not allow_cpu:
        for name in list(BUDGET)[1:]:
            c.skip(name, "no CUDA device (GPU_CHECK_ALLOW_CPU=1 runs the CPU dry run)")
        summarise(c)
        c.save()
        print(f"gpu_check: no CUDA device; figures in {out}")
        return 1
    c.set_mode(not cuda)
    c.result["mode"] = "cpu-dry-run" if c.cpu else "cuda"
    c.result["budget_scale"] = c.scale
    device = "cpu" if c.cpu else "cuda"
    vllm = env.get("vllm_import_error") is None
    chosen = {s.strip() for s in args.stages.split(",") if s.strip()}
    unknown = chosen - set(BUDGET)
    if unknown:
        raise SystemExit(f"--stages: unknown {', '.join(sorted(unknown))}; known: {list(BUDGET)}")
    for name, fn in (
        ("train", lambda: stage_train(c, vllm)),
        ("check_layout", lambda: stage_check_layout(c)),
        ("vocab_parallel", lambda: stage_vocab_parallel(c, device)),
        ("step", lambda: stage_step(c, device)),
        ("memory_7b", lambda: stage_memory_7b(c, device)),
    ):
        if name not in chosen:
            c.skip(name, "not in --stages")
            continue
        if time.monotonic() > c.deadline:
            c.skip(name, "the check's time budget was spent")
            continue
        try:
            fn()
        except Exception as e:  # a bug of this driver in one stage must not lose the others
            c.record(name, status="fail", error=f"driver: {type(e).__name__}: {e}")
        print(f"gpu_check: {name}: {c.result['stages'][name].get('status')}", flush=True)
    summarise(c)
    c.result["seconds"] = round(time.monotonic() - t0, 2)
    c.save()
    print(f"gpu_check: figures in {out}")
    return 0 if not c.result["figures"]["stages_failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
