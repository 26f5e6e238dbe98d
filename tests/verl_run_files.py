"""What a backend=verl run reads, built offline for the verl tests (tests/test_verl_preflight.py,
tests/test_verl_slurm.py): a tiny Hugging Face model folder, DAPO-Math rows as verl's training
parquet file, MATH-500 rows as its benchmark file, and the recipe overrides that point a paper
recipe at them.

    files = write_run_files(tmp_path)        # .model, .train, .bench_dir
    overrides = files.recipe_overrides()     # backend=verl, model.pretrained=..., data.path=...
    LINE                                     # the entry's last line on these files, without a GPU
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/qwen3-1.7b-dapo17k.yaml"
DAPO = ROOT / "tests/fixtures/dapo_math.jsonl"  # verl's layout already (DAPO-Math-17k's release)
MATH500 = ROOT / "tests/fixtures/bench/math500.jsonl"
BATCH = 4  # grpo.prompts_per_step: verl's data.train_batch_size, the batch the preflight scores
TRAIN_ROWS, VAL_ROWS = 15, 3  # the two fixture files' rows (verl keeps them all: short prompts)
LINE = (
    f"[megatron-ba] verl: checked config, {TRAIN_ROWS} training / {VAL_ROWS} validation prompts "
    f"through verl's RLHFDataset, reward on a batch of {BATCH} ({BATCH} right, {BATCH} wrong); "
    f"verl's ppo_megatron_trainer needs CUDA GPUs (megatron-core actor, vLLM rollout) and none "
    f"is visible: stopping before training"
)


@dataclass
class RunFiles:
    model: Path
    train: Path
    bench_dir: Path

    def recipe_overrides(self, *extra: str) -> list[str]:
        """The recipe cut to the files here: one benchmark, one step of BATCH prompts."""
        return [
            "backend=verl",
            f"model.pretrained={self.model}",
            f"data.path={self.train}",
            f"eval.data_dir={self.bench_dir}",
            "eval.benchmarks=[math500]",
            f"grpo.prompts_per_step={BATCH}",
            "grpo.mini_batches=1",
            "grpo.group_size=2",
            "grpo.steps=1",
            "reward.workers=1",
            *extra,
        ]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def dapo_rows() -> list[dict]:
    return [json.loads(line) for line in DAPO.read_text().splitlines()]


def math500_rows() -> list[dict]:
    """MATH-500's fixture rows in verl's layout (chat prompt, data_source, ground truth)."""
    rows = [json.loads(line) for line in MATH500.read_text().splitlines()]
    return [
        {
            "data_source": "math500",
            "prompt": [{"role": "user", "content": r["problem"]}],
            "reward_model": {"ground_truth": r["answer"], "style": "rule"},
            "extra_info": {"index": r["unique_id"]},
        }
        for r in rows
    ]


def write_run_files(root: Path) -> RunFiles:
    from megatron_ba.testing.tiny_hf import build_tiny_qwen2

    model = build_tiny_qwen2(root / "tiny-model", num_layers=1)
    train, val = dapo_rows(), math500_rows()
    assert (len(train), len(val)) == (TRAIN_ROWS, VAL_ROWS), "the fixtures changed: update LINE"
    train = write_parquet(root / "data/dapo-math-17k.parquet", train)
    bench = root / "bench"
    write_parquet(bench / "math500.parquet", val)
    return RunFiles(model, train, bench)
