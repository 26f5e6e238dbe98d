"""The engines' table: where the prompts and rewards go (`data.*`, `reward.*`, `warmstart.*`).

verl reads local parquet files in its own layout and scores them with this project's rewards
(integrations/verl/reward.py); NeMo-RL reads DAPO-Math-17k's hub release with its own data set
and local benchmark files, and scores with its math environment; NeMo-Aligner reads the prompt
files `megatron-ba train` writes from the recipe (the local backend's prompts).
"""

from __future__ import annotations

from pathlib import Path

from megatron_ba.integrations.engines.cells import Absent, Dropped, Need, Put, Row, Set, put
from megatron_ba.integrations.engines.model_rows import warm_start

# verl loads its custom reward function by file path: this project's rewards (verl/reward.py)
REWARD_FUNCTION = Path(__file__).resolve().parents[1] / "verl" / "reward.py"
DAPO_HUB_ID = "BytedTsinghua-SIA/DAPO-Math-17k"  # what NeMo-RL's DAPOMath17K data set loads
ARITHMETIC = "the arithmetic task's ({} trains on {})"
PROMPT_FILES = "the prompt files (RUN_DIR/data/*.jsonl: the local backend's prompt stream)"


def data_parallel(job) -> int:
    """NeMo-Aligner's data-parallel ranks: nodes x devices over TP x PP."""
    return job.nodes * job.devices // (job.parallel.tp * job.parallel.pp)


def _is_math(engine: str, what: str) -> Need:
    return Need(
        lambda j: j.data.task == "math", lambda j: f"{engine} trains on {what}, got {j.data.task!r}"
    )


def _needs_budget(engine: str, key: str) -> Need:
    return Need(
        lambda j: j.data.max_prompt_tokens is not None,
        f"{engine} needs a prompt budget ({key}); set it",
    )


ROWS: dict[str, Row] = {
    "data.task": Row(
        Put(
            needs=(_is_math("the verl backend", "a data file (math)"),),
            doc="math only; arithmetic refused",
        ),
        Put(needs=(_is_math("NeMo-RL", "a math data set"),), doc="math only; arithmetic refused"),
        Put(doc=f"{PROMPT_FILES}; either task"),
    ),
    "data.path": Row(
        put(
            "data.train_files",
            note="a local parquet in verl's layout; a hub id refused",
            need=Need(
                lambda j: str(j.data.path).endswith(".parquet"),
                lambda j: (
                    "verl reads a local parquet file in its own layout (prompt "
                    "messages, reward_model.ground_truth, data_source), got "
                    f"{j.data.path!r}; DAPO-Math-17k's release file is in it"
                ),
            ),
        ),
        Put(
            (
                Set("data.train.dataset_name", "DAPOMath17K"),
                Set("data.train.split_validation_size", 0),
            ),
            (
                Need(
                    lambda j: j.data.path == DAPO_HUB_ID,
                    lambda j: (
                        f"NeMo-RL's DAPOMath17K loads the hub release {DAPO_HUB_ID} itself "
                        f"(its cache serves offline runs), got {j.data.path!r}"
                    ),
                ),
            ),
            doc=f"{DAPO_HUB_ID} only: data.train.dataset_name=DAPOMath17K (NeMo-RL loads that "
            "hub release itself), data.train.split_validation_size=0",
        ),
        Put(doc=PROMPT_FILES),
    ),
    "data.dataset": Row(
        Put(
            needs=(
                Need(
                    lambda j: j.data.dataset == "dapo-math-17k",
                    lambda j: (
                        "verl reads the file's rows as they are; only DAPO-Math-17k's "
                        "release (in verl's layout, data_source math_dapo) is translated, got "
                        f"{j.data.dataset!r}; this project does not convert other releases to "
                        "verl's layout yet"
                    ),
                ),
            ),
            doc="dapo-math-17k only (its release is in verl's layout); polaris refused",
        ),
        Put(
            needs=(
                Need(
                    lambda j: j.data.dataset == "dapo-math-17k",
                    lambda j: (
                        "NeMo-RL v0.7.0 has a DAPO-Math-17k data set (DAPOMath17K) "
                        f"and none for {j.data.dataset!r}; this project does not convert other "
                        "releases for NeMo-RL yet"
                    ),
                ),
            ),
            doc="dapo-math-17k only; polaris refused (NeMo-RL has no Polaris data set)",
        ),
        Put(doc=PROMPT_FILES),
    ),
    "data.template": Row(
        Put(
            needs=(
                Need(
                    lambda j: j.data.template == "dapo",
                    lambda j: (
                        "verl uses the prompts the file holds (DAPO-Math-17k's: the "
                        f"dapo template), got {j.data.template!r}"
                    ),
                ),
            ),
            doc="dapo only (the prompts DAPO-Math-17k's file holds); others refused",
        ),
        Put(
            (
                Set("data.default.prompt_file", None, note="the release's prompts are templated"),
                Set("env.math.math_verify_impl", "dapo_math_verify"),
            ),
            (
                Need(
                    lambda j: j.data.template == "dapo",
                    lambda j: (
                        f"DAPOMath17K's prompts are the dapo template's, got {j.data.template!r}"
                    ),
                ),
            ),
            doc="dapo only (the prompts of DAPO-Math-17k's release): "
            "data.default.prompt_file=null, env.math.math_verify_impl=dapo_math_verify",
        ),
        Put(doc=PROMPT_FILES),
    ),
    "data.train_prompts": Row(
        put(
            Set("data.train_max_samples", when=lambda j: j.data.train_prompts is not None),
            note="verl: a random subset seeded by data.seed, then the long prompts dropped",
        ),
        Absent("NeMo-RL's DAPOMath17K data set reads the whole release"),
        Put(doc=PROMPT_FILES),
    ),
    "data.max_prompt_tokens": Row(
        put(
            "data.max_prompt_length",
            Set("data.filter_overlong_prompts", True),
            need=_needs_budget("verl", "data.max_prompt_length"),
        ),
        put(
            "data.max_input_seq_length",
            Set(
                "policy.max_total_sequence_length",
                lambda j: j.data.max_prompt_tokens + j.grpo.max_new_tokens,
            ),
            doc="data.max_input_seq_length (NeMo-RL cuts a longer prompt and gives it "
            "loss_multiplier 0), policy.max_total_sequence_length = it + grpo.max_new_tokens "
            "(required)",
            need=_needs_budget("NeMo-RL", "data.max_input_seq_length"),
        ),
        Put(doc=PROMPT_FILES),
    ),
    "data.on_conflict": Row(
        Absent("how this project's loader reads the release (verl reads every row)"),
        Absent("how this project's loader reads the release (NeMo-RL reads every row)"),
        Put(doc=PROMPT_FILES),
    ),
    "data.eval_prompts": Row(
        Absent("prompts held out of data.path; verl validates on eval.benchmarks files"),
        Absent("prompts held out of data.path; NeMo-RL validates on eval.benchmarks files"),
        put(
            "model.reinforce.num_val_samples",
            Set(
                "model.reinforce.val_rollout_micro_batch_size",
                lambda j: j.data.eval_prompts // data_parallel(j),
                note="a DP rank's share",
            ),
            need=Need(
                lambda j: j.data.eval_prompts % data_parallel(j) == 0,
                lambda j: (
                    f"{j.data.eval_prompts} held-out prompts do not split over "
                    f"{data_parallel(j)} data-parallel ranks (each rank validates on its own "
                    "part)"
                ),
            ),
        ),
    ),
    **{
        f"data.{k}": Row(
            Absent(ARITHMETIC.format("verl", "the data.path file")),
            Absent(ARITHMETIC.format("NeMo-RL", "DAPO-Math-17k's release")),
            Put(doc=PROMPT_FILES),
        )
        for k in ("min_terms", "max_terms", "sloppy_restates", "seed")
    },
    "reward.workers": Row(
        put("reward.num_workers"),
        put("env.math.num_workers"),
        Dropped("NeMo-Aligner's loop scores in-process (megatron_ba.rewards' math_score_batch)"),
    ),
    "reward.timeout_s": Row(
        Put(
            (
                Set("reward.custom_reward_function.path", str(REWARD_FUNCTION)),
                Set("reward.custom_reward_function.name", "compute_score"),
                Set("+reward.custom_reward_function.reward_kwargs.timeout_s"),
            ),
            doc="reward.custom_reward_function.path, reward.custom_reward_function.name="
            "compute_score (integrations/verl/: this project's rewards, the math or the code "
            "one by each row's data_source) and the timeout_s of its reward_kwargs",
        ),
        Absent(
            "this project's math-verify workers' limit (NeMo-RL's math environment scores "
            "with its own)"
        ),
        Dropped("NeMo-Aligner's loop scores in-process (megatron_ba.rewards' math_score_batch)"),
    ),
    "warmstart.enabled": Row(
        Put(doc="false (required with model.pretrained)"),
        Put(doc="false (required with model.pretrained)"),
        Dropped("the local backend's warm start (NeMo-Aligner restores a .nemo file)"),
    ),
    **{
        f"warmstart.{k}": Row(
            Absent(warm_start("verl")),
            Absent(warm_start("NeMo-RL")),
            Dropped("the local backend's warm start (NeMo-Aligner restores a .nemo file)"),
        )
        for k in ("steps", "batch_size", "lr", "correct_fraction", "seed")
    },
}
