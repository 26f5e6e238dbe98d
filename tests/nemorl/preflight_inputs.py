"""The inputs of a `backend=nemo_rl` run made locally for tests/nemorl's preflight tests: a tiny
Hugging Face model, the benchmark files, and a DAPO-Math-17k release in the hub's layout.

NeMo-RL's DAPOMath17K data set calls `datasets.load_dataset("BytedTsinghua-SIA/DAPO-Math-17k")`;
`datasets` resolves a hub id to a local folder of that name under the working directory first, so
a run started in `where` loads these rows through NeMo-RL's own data set code, offline.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QWEN = ROOT / "recipes/qwen3-1.7b-dapo17k.yaml"
# (prompt, ground truth) rows of the training file; DAPO's own prompt ends with its Answer: line
TRAIN = [
    ("What is 1 + 1?", "2"),
    ("What is half of 1?", "\\frac{1}{2}"),
    ("What is 3 times 4?", "12"),
    ("Write x times x as a power.", "x^2"),
    ("What is 10 - 7?", "3"),
    ("What is 2 to the power 5?", "32"),
]
BENCH = {
    "aime24": [("What is 6 + 7?", "13"), ("What is 5 squared?", "25")],
    "aime25": [("What is 100 / 4?", "25")],
}
PROMPTS_PER_STEP = 4  # the batch the preflight scores: the first 4 training rows


def write_train(where: Path, rows=TRAIN) -> Path:
    """DAPO-Math-17k's columns (prompt: chat messages, reward_model.ground_truth) as the
    `train` split of a local BytedTsinghua-SIA/DAPO-Math-17k folder."""
    import datasets

    folder = where / "BytedTsinghua-SIA" / "DAPO-Math-17k"
    folder.mkdir(parents=True, exist_ok=True)
    records = [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": f"{q}\n\nRemember to put your answer on its "
                                                   f'own line after "Answer:".'}],
            "ability": "MATH",
            "reward_model": {"ground_truth": a, "style": "rule-lighteval/MATH_v2"},
        }
        for q, a in rows
    ]  # fmt: skip
    datasets.Dataset.from_list(records).to_parquet(str(folder / "train.parquet"))
    return folder


def write_bench(where: Path, files=BENCH) -> Path:
    import json

    bench = where / "bench"
    bench.mkdir(parents=True, exist_ok=True)
    for name, rows in files.items():
        text = "".join(json.dumps({"problem": q, "answer": a}) + "\n" for q, a in rows)
        (bench / f"{name}.jsonl").write_text(text)
    return bench


def make_inputs(where: Path) -> list[str]:
    """Write the model, benchmark files and training release under `where`; the recipe overrides
    (besides the recipe) of a run started in `where`."""
    from megatron_ba.testing.tiny_hf import build_tiny_qwen3

    model = build_tiny_qwen3(where / "tiny")
    bench = write_bench(where)
    write_train(where)
    return [
        "backend=nemo_rl",
        "grpo.mini_batches=1",
        "eval.samples=1",
        f"eval.benchmarks={','.join(BENCH)}",
        f"eval.data_dir={bench}",
        f"model.pretrained={model}",
        f"grpo.prompts_per_step={PROMPTS_PER_STEP}",
    ]


def run_env(hide_gpus: bool = True, **extra: str) -> dict:
    """This environment for a run: this checkout importable, nothing downloaded, no Ray address
    of the caller's (a test suite's own Ray head); hide_gpus: no GPU visible, so the preflight's
    CPU branch runs on any machine (not for a Slurm job: the launcher's `ray start --num-gpus=G`
    refuses an empty CUDA_VISIBLE_DEVICES)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SLURM_JOB"))}
    env["PYTHONPATH"] = str(ROOT) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("PYTHON", sys.executable)
    env.update(extra)
    return env


def expected_line(train: int, val: int, batch: int) -> str:
    return (
        f"[megatron-ba] nemo_rl: checked MasterConfig, {train} training / {val} validation "
        f"prompts through NeMo-RL's data processors, math reward on a batch of {batch} ({batch} "
        f"right, {batch} wrong); NeMo-RL's GRPO with policy.megatron_cfg needs CUDA GPUs "
        f"(megatron-core policy, vLLM generation) and none is visible: stopping before training"
    )
