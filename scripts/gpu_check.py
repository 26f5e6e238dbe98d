"""The single-GPU check: each stage a subprocess with its own time budget, figures in JSON.

    python scripts/gpu_check.py --out gpu_check.json      # normally via scripts/gpu_check.sh
    GPU_CHECK_ALLOW_CPU=1 python scripts/gpu_check.py --out /tmp/g.json   # CPU dry run, tiny sizes

Stages (each "pass", "fail" or "skipped", with its command, seconds, exit status, figures and the
tail of its output; the file is rewritten after every stage, so a kill leaves what was done):
  env            torch / CUDA / GPU / Transformer Engine / vLLM / megatron-core versions, SDPA
                 kernels enabled, pip check
  attention, train_0p5b, memory_1p5b, step, train, vocab_parallel: scripts/gpu_check_stages.py

Without CUDA every stage but env is skipped unless GPU_CHECK_ALLOW_CPU=1, which runs them on the
CPU at tiny sizes in fp32 (the plumbing, not the figures), with CPU_BUDGET_SCALE times the time
budgets. On a GPU the stages' budgets add up to STAGE_BUDGET_S, so the whole check (with
gpu_check.sh's venv and install) ends within 10 minutes.
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
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]  # megatron_ba, the stages

import gpu_check_stages as stages  # noqa: E402

# Seconds per stage, most wanted first; their sum (STAGE_BUDGET_S, 490) fits gpu_check.sh's cap
# (495 s): with its venv (20 s), install (30 s) and kill grace (10 s), 555 s < 10 minutes.
BUDGET = {
    "env": 25,
    "attention": 30,
    "train_0p5b": 130,
    "memory_1p5b": 90,
    "step": 75,
    "aggregation": 20,
    "train": 70,
    "vocab_parallel": 50,
}
STAGE_BUDGET_S = sum(BUDGET.values())
# The CPU dry run proves the plumbing on a (possibly shared) CPU machine, where the 10 minutes do
# not apply: its budgets are this many times the GPU's.
CPU_BUDGET_SCALE = 4
NEW_KEYS = ("model.precision", "model.transformer_impl", "model.attention")


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
        # which of SDPA's CUDA kernels torch may pick (all on unless someone turned one off)
        "sdpa_kernels_enabled": {
            name: getattr(torch.backends.cuda, f"{name}_sdp_enabled", lambda: None)()
            for name in ("flash", "mem_efficient", "math", "cudnn")
        },
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
    out["sdpa_attention_import_error"] = _importable("megatron_ba.megatron.sdpa_attention")
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
        """Run one stage's command under its budget; figures(output) -> dict, read whatever the
        exit status (a command that fails its own criteria still writes its figures)."""
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
        if figures is not None:
            # A command that fails its own criteria (exit 1) may still have written its figures.
            try:
                stage["figures"] = figures(text)
            except Exception as e:  # the command did not get as far as its figures
                if rc == 0:
                    stage["error"] = f"figures: {type(e).__name__}: {e}"
        if rc != 0:
            stage.update(status="fail", error=_why(text, rc))
        else:
            stage["status"] = "fail" if "error" in stage else "pass"
        return self.record(name, **stage)

    def skip(self, name: str, why: str) -> None:
        self.record(name, status="skipped", error=why)


def _why(text: str, rc: int) -> str:
    """The clearest one-line reason a stage failed."""
    for key in NEW_KEYS:
        if key in text and re.search(r"unknown|not a key|no such key|unexpected", text, re.I):
            return f"recipe key {key} is not known to this checkout; exit {rc}"
    if rc == 124:
        return "timed out"
    if "OutOfMemoryError" in text or "CUDA out of memory" in text:
        return f"CUDA out of memory; exit {rc}"
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"Error|error:|Exception", ln)]
    return f"exit {rc}: {(errors or lines or [''])[-1].strip()[:400]}"


def _summarise_new_stages(s: dict, f: dict) -> None:
    att = s.get("attention", {}).get("figures", {})
    for dtype, a in att.get("accuracy", {}).items():
        f[f"attention_{dtype}_sdpa_rel_err"] = a["sdpa_rel_err"]
        f[f"attention_{dtype}_unfused_rel_err"] = a["unfused_rel_err"]
    for core in ("sdpa", "unfused"):
        if core in att.get("memory", {}):
            f[f"attention_{core}_peak_extra_mib"] = att["memory"][core]["peak_extra_mib"]
    lm = s.get("train_0p5b", {}).get("figures", {})
    if lm:
        t, fell = lm["throughput"], lm["loss_fell"]
        f.update(
            train_0p5b_loss_first=fell["first"],
            train_0p5b_loss_last=fell["last"],
            train_0p5b_loss_fell=fell["ok"],
            train_0p5b_tokens_per_s=t["tokens_per_s"],
            train_0p5b_mfu=t["mfu"],
            train_0p5b_mfu_full_attention=t["mfu_full_attention"],
            train_0p5b_peak_tflops=t["peak_tflops"],
        )
        comparison = lm.get("precision_comparison") or {}
        if comparison:
            f["train_0p5b_precision_max_rel_diff"] = comparison["max_rel_diff"]
            f["train_0p5b_precision_ok"] = comparison["ok"]
    mem = s.get("memory_1p5b", {})
    if "figures" in mem:
        m = mem["figures"]
        for k in ("measured_peak_gib", "measured_peak_reserved_gib", "measured_over_estimate"):
            f[f"memory_1p5b_{k}"] = m[k]
    if "planner" in mem:
        f["memory_1p5b_estimate_gib"] = mem["planner"]["estimate_gib"]


def summarise(c: Check) -> None:
    """The headline figures, one level deep, for docs/performance.md."""
    s, f = c.result["stages"], c.result["figures"]
    _summarise_new_stages(s, f)
    step = s.get("step", {}).get("figures", {})
    for k in (
        "ratio_ba_over_token_mean",
        "paired_ratio_median",
        "ba_median_s",
        "token_mean_median_s",
        "ba_peak_mib",
        "token_mean_peak_mib",
        "transformer_impl",
        "attention",
        "parameters",
        "tokens_per_step",
    ):
        if k in step:
            f[f"step_{k}"] = step[k]
    agg = s.get("aggregation", {}).get("figures", {})
    if agg:
        f["aggregation_grpo_loss_ratio"] = agg["ratio_grpo_loss"]
        for k in ("packed/grpo-loss-balanced", "packed/grpo-loss-token-mean"):
            f[f"aggregation_{k.split('/')[1].replace('-', '_')}_ms"] = agg["median_ms"][k]
    vp = s.get("vocab_parallel", {}).get("figures", {}).get("variants", {})
    for v, row in vp.items():
        f[f"vocab_parallel_{v}_peak_extra_mib"] = row["peak_extra_mib"]
        f[f"vocab_parallel_{v}_median_s"] = row["median_s"]
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
        ("attention", lambda: stages.stage_attention(c, device)),
        ("train_0p5b", lambda: stages.stage_train_lm(c)),
        ("memory_1p5b", lambda: stages.stage_memory_1p5b(c)),
        ("step", lambda: stages.stage_step(c, device)),
        ("aggregation", lambda: stages.stage_aggregation(c, device)),
        ("train", lambda: stages.stage_train(c, vllm)),
        ("vocab_parallel", lambda: stages.stage_vocab_parallel(c, device)),
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
