"""The engines' table: validation (`eval.*`).

verl validates on local parquet benchmark files (data.val_files), scored by this project's
rewards by each row's data_source; NeMo-RL on local JSON Lines files through its math
environment (no LiveCodeBench: it scores answers, not programs); NeMo-Aligner on the recipe's
held-out prompts (the validation prompt file).
"""

from __future__ import annotations

from megatron_ba.integrations.engines.cells import Absent, Dropped, Need, Put, Row, Set, put
from megatron_ba.integrations.engines.model_rows import GEN, R

EVAL_PROMPT_FILE = "data/nemo_rl_eval_prompt.txt"  # in the run folder
# grpo.max_val_samples: NeMo-RL validates max_val_samples // val_batch_size batches (stock 256 //
# 256: one batch, which would cut MATH-500); this bound lets every benchmark prompt through
ALL_VAL_SAMPLES = 100_000
VALIDATES_HELD_OUT = "NeMo-Aligner validates on the held-out prompts (data.eval_prompts)"


def eval_prompt_path(run_dir: str | None) -> str:
    """Where the command writes NeMo-RL's validation prompt template (its prompt_file)."""
    return f"{run_dir or 'RUN_DIR'}/{EVAL_PROMPT_FILE}"


def _validation_sets(job) -> list[dict]:
    """NeMo-RL's data.validation: one ResponseDataset per benchmark file."""
    prompt_file = eval_prompt_path(job.run_dir)
    return [
        {
            "dataset_name": "ResponseDataset",
            "data_path": f"{job.eval.data_dir}/{name}.jsonl",
            "input_key": "problem",
            "output_key": "answer",
            "prompt_file": prompt_file,
        }
        for name in job.eval.benchmarks
    ]


def _same_budget(engine: str, how: str) -> Need:
    return Need(
        lambda j: j.eval.max_new_tokens in (None, j.grpo.max_new_tokens),
        lambda j: f"{engine} validates with the training budget{how.format(j)}; use null",
    )


ROWS: dict[str, Row] = {
    "eval.every": Row(
        put(
            Set("trainer.test_freq", lambda j: j.eval.every or j.grpo.steps, note="0: grpo.steps"),
            Set("trainer.val_before_train", True),
        ),
        put(
            Set("grpo.val_period", lambda j: j.eval.every or j.grpo.steps, note="0: grpo.steps"),
            Set("grpo.val_at_start", True),
            Set("grpo.val_at_end", True),
        ),
        put(
            Set(
                "trainer.reinforce.val_check_interval",
                lambda j: j.eval.every or j.grpo.steps,
                note="0: grpo.steps",
            )
        ),
    ),
    "eval.samples": Row(
        put(f"{R}.val_kwargs.n"),
        Put(
            needs=(
                Need(
                    lambda j: j.eval.samples == 1,
                    lambda j: (
                        "NeMo-RL's validation generates one response per prompt, got "
                        f"{j.eval.samples}; set 1"
                    ),
                ),
            ),
            doc="1 only (NeMo-RL's validation generates one response per prompt); others refused",
        ),
        Dropped("NeMo-Aligner validates one response per held-out prompt"),
    ),
    "eval.temperature": Row(
        put(
            f"{R}.val_kwargs.temperature",
            Set(f"{R}.val_kwargs.do_sample", lambda j: j.eval.temperature > 0),
        ),
        Put(
            needs=(
                Need(
                    lambda j: j.eval.temperature == j.grpo.temperature,
                    lambda j: (
                        f"NeMo-RL validates with the training sampler "
                        f"({j.grpo.temperature}), got {j.eval.temperature}"
                    ),
                ),
            ),
            doc=f"only grpo.temperature (NeMo-RL validates with {GEN}); others refused",
        ),
        Dropped("NeMo-Aligner validates with the training sampler"),
    ),
    "eval.benchmarks": Row(
        put(
            Set(
                "data.val_files",
                lambda j: [f"{j.eval.data_dir}/{name}.parquet" for name in j.eval.benchmarks],
            ),
            note="eval.data_dir/NAME.parquet each; required",
            need=Need(
                lambda j: bool(j.eval.benchmarks),
                "verl validates on files (data.val_files): name the benchmarks and eval.data_dir",
            ),
        ),
        Put(
            (
                Set("data.validation", _validation_sets),
                Set("grpo.max_val_samples", ALL_VAL_SAMPLES),
            ),
            (
                Need(
                    lambda j: bool(j.eval.benchmarks),
                    "NeMo-RL validates on files: name the benchmarks and eval.data_dir",
                ),
                Need(
                    lambda j: "livecodebench" not in j.eval.benchmarks,
                    "livecodebench: NeMo-RL's math environment scores answers, not programs; "
                    "leave it out",
                ),
            ),
            doc="data.validation: one ResponseDataset per name, eval.data_dir/NAME.jsonl "
            "(input_key problem, output_key answer); livecodebench refused (NeMo-RL's math "
            "environment scores answers, not programs); grpo.max_val_samples large enough for "
            "all",
        ),
        Dropped(VALIDATES_HELD_OUT),
    ),
    "eval.data_dir": Row(
        Put(
            needs=(
                Need(
                    lambda j: j.eval.data_dir is not None,
                    "verl reads local benchmark "
                    "files in its layout, DIR/NAME.parquet; set the folder",
                ),
            ),
            doc="data.val_files (required: verl reads local files)",
        ),
        Put(
            needs=(
                Need(
                    lambda j: j.eval.data_dir is not None,
                    "NeMo-RL reads local benchmark "
                    "files, DIR/NAME.jsonl (problem, answer); set the folder",
                ),
            ),
            doc="data.validation's data_path (required: local files)",
        ),
        Dropped(VALIDATES_HELD_OUT),
    ),
    "eval.template": Row(
        Absent("verl uses the benchmark files' prompts as they are"),
        Put(
            needs=(
                Need(
                    lambda j: j.eval.template == "dapo",
                    "one math environment scores "
                    "training and validation (dapo_math_verify); use dapo",
                ),
            ),
            doc="dapo only: each data.validation entry's prompt_file "
            "(RUN_DIR/data/nemo_rl_eval_prompt.txt, written by the command)",
        ),
        Dropped(VALIDATES_HELD_OUT),
    ),
    "eval.max_new_tokens": Row(
        Put(
            needs=(_same_budget("verl", " data.max_response_length ({0.grpo.max_new_tokens})"),),
            doc="null or grpo.max_new_tokens (verl validates with data.max_response_length); "
            "others refused",
        ),
        Put(
            needs=(_same_budget("NeMo-RL", " ({0.grpo.max_new_tokens})"),),
            doc=f"null or grpo.max_new_tokens (NeMo-RL validates with {GEN}.max_new_tokens); "
            "others refused",
        ),
        Dropped("NeMo-Aligner validates with the training budget"),
    ),
}
