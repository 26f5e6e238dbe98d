"""The verl entry's preflight: verl's composed config, model folder, data and reward, checked with
verl's own code before verl's trainer starts (main_ppo.py calls `run` after check_config).

    line = run(config)   # on a machine without CUDA: prints the line, exits with NEEDS_GPU

1. the config: verl's own `validate_config`, as verl's main calls it (batch sizes against the GPU
   count, micro-batch settings...);
2. the model folder (actor_rollout_ref.model): verl's HFModelConfig, as verl's v1 trainer builds
   its tokenizer and processor (`omega_conf_to_dataclass`), which also reads the HF config;
3. the data: each of data.train_files and data.val_files through verl's `create_rl_dataset`
   (RLHFDataset, with config.data: the chat template, the prompt-length filter), as the trainer
   calls it; a file that yields no row is refused by name, and so is a training set smaller than
   one step's prompts (data.train_batch_size); then one batch of the training set through the
   trainer's sampler and verl's `collate_fn`;
4. the reward: verl's `load_reward_manager(config, tokenizer)` (the recipe points it at this
   project's math reward, reward.py), and for each row of the batch verl's `run_single` on a
   response that states the row's ground truth on an "Answer:" line (must score 1) and one that
   states another answer (must score 0): a row the reward scores otherwise means the data and the
   reward disagree, and is refused naming the row and its data_source.

Then, when torch sees no CUDA GPU, it prints one line to stdout and exits with status NEEDS_GPU:

    [megatron-ba] verl: checked config, N training / M validation prompts through verl's
    RLHFDataset, reward on a batch of B (B right, B wrong); verl's ppo_megatron_trainer needs CUDA
    GPUs (megatron-core actor, vLLM rollout) and none is visible: stopping before training

(one line; wrapped here). A failed check raises PreflightError (main_ppo.py prints it and exits
with status 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from omegaconf import OmegaConf

from megatron_ba.integrations.exit_status import NEEDS_GPU

PREFIX = "[megatron-ba] verl:"


class PreflightError(ValueError):
    """A check failed: the message names the config key or file and what is wrong."""


@dataclass
class Checked:
    train: int  # prompts of data.train_files after verl's filters
    val: int  # prompts of data.val_files
    batch: int  # rows scored
    right: int  # rows whose ground-truth response scored 1
    wrong: int  # rows whose wrong response scored 0

    def line(self) -> str:
        return (
            f"{PREFIX} checked config, {self.train} training / {self.val} validation prompts "
            f"through verl's RLHFDataset, reward on a batch of {self.batch} ({self.right} right, "
            f"{self.wrong} wrong)"
        )


def run(
    config,
    *,
    trainer: str = "ppo_megatron_trainer",
    validate: bool = True,
    step: tuple[int, str] | None = None,
) -> str:
    """The checks above; the summary line. Without a CUDA GPU: the line and exit NEEDS_GPU.

    For verl's other entries: `trainer` names it in that line; `validate=False` skips verl's
    validate_config where that entry does not call it (the fully asynchronous one, whose
    data.train_batch_size of 0 it would refuse); `step` is (prompts, the keys that set them) of
    one step's batch where data.train_batch_size is not it."""
    if validate:
        check_engine_config(config)
    model = load_model(config)
    train = dataset(config, "data.train_files", model, is_train=True)
    val = dataset(config, "data.val_files", model, is_train=False)
    batch = first_batch(config, train, step)
    right, wrong = score_batch(config, model.tokenizer, batch)
    line = Checked(len(train), len(val), len(batch["data_source"]), right, wrong).line()
    if not torch.cuda.is_available():
        print(
            f"{line}; verl's {trainer} needs CUDA GPUs (megatron-core actor, vLLM "
            f"rollout) and none is visible: stopping before training",
            flush=True,
        )
        raise SystemExit(NEEDS_GPU)
    return line


def check_engine_config(config) -> None:
    """verl's own validate_config, with the arguments verl's main passes."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    try:
        validate_config(
            config=config,
            use_reference_policy=need_reference_policy(config),
            use_critic=need_critic(config),
        )
    except (AssertionError, ValueError) as err:  # verl's message names its keys
        raise PreflightError(f"verl's validate_config refused the config: {err}") from err


def load_model(config):
    """verl's HFModelConfig of actor_rollout_ref.model (tokenizer, processor, HF config)."""
    from verl.utils.config import omega_conf_to_dataclass

    path = config.actor_rollout_ref.model.path
    try:
        return omega_conf_to_dataclass(config.actor_rollout_ref.model)
    except Exception as err:  # verl's own message, with the key and folder it concerns
        cause = err.__cause__ or err  # Hydra's InstantiationException wraps HFModelConfig's error
        raise PreflightError(
            f"actor_rollout_ref.model.path: verl could not load the model folder {path!r}: "
            f"{type(cause).__name__}: {cause}"
        ) from err


def dataset(config, key: str, model, *, is_train: bool):
    """verl's dataset of the files under `key` (data.train_files / data.val_files), built as the
    trainer builds it; each file must yield rows of its own (one that yields none is named)."""
    files = OmegaConf.select(config, key)
    files = [files] if isinstance(files, str) else list(files or [])
    if not files:
        raise PreflightError(f"{key}: no file named")
    limit = config.data.get("train_max_samples" if is_train else "val_max_samples", -1)
    parts = [_build(config, key, [f], model, is_train, limit) for f in files]
    for path, part in zip(files, parts, strict=True):
        if len(part) == 0:
            raise PreflightError(f"{key}: {path}: {_why_empty(config, path)}")
    if len(files) == 1:
        return parts[0]
    return _build(config, key, files, model, is_train, limit)  # the trainer's: all files at once


def _build(config, key: str, files: list, model, is_train: bool, limit: int):
    from verl.trainer.ppo.utils import create_rl_dataset

    try:
        return create_rl_dataset(files, config.data, model.tokenizer, model.processor,
                                 is_train=is_train, max_samples=limit)  # fmt: skip
    except Exception as err:  # a missing file, a column verl needs...: verl's words, our key
        empty = [f for f in files if _rows(f) == 0]  # HF datasets cannot read a 0-row parquet
        if empty:
            raise PreflightError(f"{key}: {empty[0]}: {_why_empty(config, empty[0])}") from err
        raise PreflightError(
            f"{key}: {', '.join(map(str, files))}: verl's RLHFDataset could not read it: "
            f"{type(err).__name__}: {err}"
        ) from err


def _rows(path) -> int | None:
    """A parquet file's own row count (its footer), before verl's filters; None otherwise."""
    if not str(path).endswith(".parquet"):
        return None
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(path).num_rows
    except (OSError, ValueError):  # missing or not parquet: verl's own error says which
        return None


def _why_empty(config, path: str) -> str:
    """Why verl's dataset of `path` has no row: the file has none, or every prompt is longer
    than data.max_prompt_length (verl drops those: data.filter_overlong_prompts)."""
    rows, limit = _rows(path), config.data.max_prompt_length
    if rows == 0:
        return "the file has no rows: verl's RLHFDataset yields no prompt from it"
    if rows is not None:
        return (
            f"verl's RLHFDataset yields no prompt from its {rows} rows: each prompt is longer "
            f"than data.max_prompt_length={limit} tokens (data.filter_overlong_prompts)"
        )
    return (
        f"verl's RLHFDataset yields no prompt from it (no rows, or each prompt longer than "
        f"data.max_prompt_length={limit} tokens)"
    )


def first_batch(config, train, step: tuple[int, str] | None = None) -> dict:
    """The first batch of the training set as the trainer draws it: its sampler (data.shuffle,
    data.seed) and verl's collate_fn, data.train_batch_size prompts (one step's), or `step`'s."""
    from torch.utils.data import DataLoader
    from verl.trainer.ppo.utils import create_rl_sampler
    from verl.utils.dataset.rl_dataset import collate_fn

    size, keys = step or (config.data.train_batch_size, "data.train_batch_size")
    if len(train) < size:  # the trainer's loader drops the short last batch: it would yield none
        raise PreflightError(
            f"data.train_files: {len(train)} prompt(s) after verl's filters, fewer than one "
            f"step's {keys}={size}"
        )
    # in this process (num_workers=0): data.dataloader_num_workers only moves the same rows
    loader = DataLoader(train, batch_size=size, sampler=create_rl_sampler(config.data, train),
                        collate_fn=collate_fn, drop_last=True, num_workers=0)  # fmt: skip
    return next(iter(loader))


def score_batch(config, tokenizer, batch: dict) -> tuple[int, int]:
    """(rows right, rows wrong): verl's reward manager on each row's ground-truth response
    (must score 1) and a wrong one (must score 0); a row scored otherwise is refused."""
    from verl.trainer.ppo.reward import load_reward_manager

    fn = config.reward.custom_reward_function
    try:
        manager = load_reward_manager(config, tokenizer)
    except Exception as err:
        raise PreflightError(
            f"reward.custom_reward_function: verl could not load {fn.name!r} from {fn.path!r}: "
            f"{type(err).__name__}: {err}"
        ) from err
    right = wrong = 0
    for i in range(len(batch["data_source"])):
        row, truth = _row(batch, i), _ground_truth(batch, i)
        for answer, expected in ((truth, 1.0), (_wrong_answer(truth), 0.0)):
            response = f"So we get:\nAnswer: {answer}"
            try:
                score = _score(manager, tokenizer, batch, i, response)
            except Exception as err:  # the function's own failure, on this row
                raise PreflightError(
                    f"reward.custom_reward_function ({fn.path}, {fn.name}): scoring {row} "
                    f"raised {type(err).__name__}: {err}"
                ) from err
            if score != expected:
                raise PreflightError(
                    f"reward.custom_reward_function ({fn.path}): {row}, ground truth {truth!r}, "
                    f"scores {score} for the response {response!r}, not {expected}: the data "
                    f"and the reward disagree"
                )
        right, wrong = right + 1, wrong + 1
    return right, wrong


def _row(batch: dict, i: int) -> str:
    """The batch's row i as a reader finds it in the file: its extra_info.index, data_source."""
    return (
        f"row {i} of the training batch (index {batch['index'][i]!r}, data_source "
        f"{batch['data_source'][i]!r})"
    )


def _wrong_answer(truth: str) -> str:
    """An answer that differs from `truth`: x + 1 for every finite x; infinity + 1 is infinity."""
    return "0" if "infty" in truth or "∞" in truth else f"{truth} + 1"


def _ground_truth(batch: dict, i: int) -> str:
    model = batch["reward_model"][i] if "reward_model" in batch else None
    if not isinstance(model, dict) or model.get("ground_truth") in (None, ""):
        raise PreflightError(
            f"data.train_files: {_row(batch, i)} has no reward_model.ground_truth for the reward"
        )
    return str(model["ground_truth"])


def _score(manager, tokenizer, batch: dict, i: int, response: str) -> float:
    """verl's run_single on one row with `response` as its tokens, as verl's reward loop calls
    it (the response's tokens and mask; the row's data_source, reward_model, extra_info)."""
    from verl import DataProto

    ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    extra = dict(batch["extra_info"][i] or {}) if "extra_info" in batch else {}
    item = DataProto.from_dict(
        tensors={
            "responses": torch.tensor([ids]),
            "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        },
        non_tensors={
            "data_source": batch["data_source"][i : i + 1],
            "reward_model": batch["reward_model"][i : i + 1],
            "extra_info": np.array([extra], dtype=object),  # a copy: run_single adds keys
        },
    )
    result = manager.loop.run_until_complete(manager.run_single(item))
    return float(result["reward_score"])
