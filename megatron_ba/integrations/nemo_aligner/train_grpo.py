"""GRPO with Balanced Aggregation on NeMo-Aligner 0.7.0: the training entry point (Hydra).

    python -m megatron_ba.integrations.nemo_aligner.train_grpo \
        ++pretrained_checkpoint.restore_from_path=/ckpt/model.nemo \
        ++model.data.data_prefix.train=train.jsonl ++model.data.data_prefix.validation=val.jsonl \
        ++trainer.num_nodes=2 ++trainer.devices=8 ++model.tensor_model_parallel_size=2
    bash scripts/nemo_demo.sh RUN_DIR      # on a CPU: a tiny model, 10 steps, a few minutes

Config: conf/gpt_grpo_balanced.yaml. The wiring follows NeMo-Aligner's REINFORCE script
(examples/nlp/gpt/train_gpt_reinforce_actor.py at v0.7.0) with our actor and trainer and
in-process math rewards instead of the reward-model server. Data: JSONL lines
{"prompt": str, "ground_truth": str}. Without a CUDA device it installs the CPU shims
(cpu_shims.py) first. Besides NeMo's logs (TensorBoard events, checkpoints) the log folder gets
metrics.jsonl (metrics_log.py). RUN_DIR/PREEMPT stops it after the step in flight with a checkpoint,
RUN_DIR/preempted.json and exit status 75 (requeue.py; slurm/lib.sh requeues the job). What
has run where: docs/status.md.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch

from megatron_ba.integrations.nemo_aligner.config import check_config
from megatron_ba.integrations.nemo_aligner.metrics_log import MetricsJsonl
from megatron_ba.integrations.nemo_aligner.requeue import (
    PREEMPTED_EXIT_CODE,
    RunTimerWithRequests,
    mark_preempted,
)
from megatron_ba.parallel import collectives


class MathPromptDataset(torch.utils.data.Dataset):
    """JSONL prompts with ground truths, tokenized with the model's tokenizer."""

    def __init__(self, path: str, tokenizer, max_prompt_tokens: int):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f if line.strip()]
        for i, row in enumerate(self.rows):
            if not isinstance(row.get("prompt"), str) or not isinstance(
                row.get("ground_truth"), str
            ):
                raise ValueError(
                    f"{path}: line {i + 1} needs string fields 'prompt' and 'ground_truth'"
                )
        self.tokenizer, self.max_prompt_tokens = tokenizer, max_prompt_tokens

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        ids = self.tokenizer.text_to_ids(self.rows[i]["prompt"])[: self.max_prompt_tokens]
        return {
            "text": torch.tensor(ids, dtype=torch.long),
            "length": len(ids),
            "ground_truth": self.rows[i]["ground_truth"],
            "index": i,
        }


def collate(samples: list[dict], *, eos_id: int, response_length: int) -> dict:
    """NeMo-Aligner's prompt batch plus `ground_truth` and `index` (the prompts' rows in the
    file: the trainer seeds sampling by them): `text` [b, L + response_length] padded with EOS
    (NeMo's generation writes the response into that room), `length` [b]."""
    longest = max(s["length"] for s in samples)
    texts = torch.full((len(samples), longest + response_length), eos_id, dtype=torch.long)
    for i, s in enumerate(samples):
        texts[i, : s["length"]] = s["text"]
    return {
        "text": texts,
        "length": torch.tensor([s["length"] for s in samples]),
        "ground_truth": [s["ground_truth"] for s in samples],
        "index": torch.tensor([s["index"] for s in samples]),
    }


def _main(cfg) -> None:
    # Long on purpose: NeMo-Aligner's own train_gpt_reinforce_actor.py main, step for step (its
    # imports, model, data loaders, trainer, fit), so that the two read side by side.
    from megatron.core.utils import divide
    from nemo.utils.exp_manager import exp_manager
    from nemo_aligner.data.nlp.builders import build_dataloader
    from nemo_aligner.utils import parallel_state
    from nemo_aligner.utils.batch_iterators import get_batch_iterator_cls
    from nemo_aligner.utils.distributed import Timer
    from nemo_aligner.utils.train_script_utils import (
        CustomLoggerWrapper,
        add_custom_checkpoint_callback,
        extract_optimizer_scheduler_from_ptl_model,
        init_distributed,
        init_using_ptl,
        resolve_and_create_trainer,
        retrieve_custom_trainer_state_dict,
    )
    from nemo_aligner.utils.utils import load_and_override_model_config, load_from_nemo

    # NeMo-Aligner and megatron-core (actor and trainer subclass theirs): imported on use
    from megatron_ba.integrations.nemo_aligner.actor import MegatronGPTGRPOActorModel
    from megatron_ba.integrations.nemo_aligner.grpo_trainer import GRPOTrainer

    cfg.model = load_and_override_model_config(
        cfg.pretrained_checkpoint.restore_from_path, cfg.model
    )
    check_config(cfg)  # fail on a bad model.grpo / trainer.reinforce before building anything
    trainer = resolve_and_create_trainer(cfg, "reinforce")
    log_dir = exp_manager(trainer, cfg.exp_manager)
    logger = CustomLoggerWrapper(trainer.loggers)
    actor = load_from_nemo(
        MegatronGPTGRPOActorModel,
        cfg.model,
        trainer,
        strict=True,
        restore_path=cfg.pretrained_checkpoint.restore_from_path,
    )
    init_distributed(trainer, actor, cfg.model.get("transformer_engine", False))
    dp = parallel_state.get_data_parallel_world_size()
    max_prompt = cfg.model.encoder_seq_length - cfg.model.reinforce.length_params.max_length
    train_ds = MathPromptDataset(cfg.model.data.data_prefix.train, actor.tokenizer, max_prompt)
    val_ds = MathPromptDataset(cfg.model.data.data_prefix.validation, actor.tokenizer, max_prompt)
    rc = cfg.model.reinforce
    collate_fn = partial(
        collate, eos_id=actor.tokenizer.eos_id, response_length=rc.length_params.max_length
    )
    train_builder = partial(
        build_dataloader,
        cfg=cfg,
        dataset=train_ds,
        mbs=rc.rollout_micro_batch_size,
        gbs=rc.num_rollout_samples,
        collate_fn=collate_fn,
        load_gbs=False,
        use_random_sampler=bool(cfg.model.data.get("shuffle", True)),
    )
    val_builder = partial(
        build_dataloader,
        cfg=cfg,
        dataset=val_ds,
        mbs=rc.val_rollout_micro_batch_size,
        gbs=rc.num_val_samples,
        collate_fn=collate_fn,
        load_gbs=False,
        use_random_sampler=False,
    )
    divide(rc.num_rollout_samples, dp)  # every DP rank generates for its own prompts
    init_using_ptl(trainer, actor, train_builder(consumed_samples=0), train_ds)
    optimizer, scheduler = extract_optimizer_scheduler_from_ptl_model(actor)
    # stops after a step when time is up or RUN_DIR/PREEMPT appears (requeue.py)
    run_timer = RunTimerWithRequests(Timer(cfg.exp_manager.get("max_time_per_run")), log_dir)
    grpo = GRPOTrainer(
        cfg=cfg.trainer.reinforce,
        model=actor,
        optimizer=optimizer,
        scheduler=scheduler,
        train_dataloader_builder=train_builder,
        val_dataloader_builder=val_builder,
        collate_fn=collate_fn,
        rm=None,
        batch_iterator_cls=get_batch_iterator_cls(cfg.trainer.reinforce.batch_iterator),
        logger=logger,
        ckpt_callback=add_custom_checkpoint_callback(trainer, actor),
        run_timer=run_timer,
    )
    state = retrieve_custom_trainer_state_dict(trainer)
    if state is not None:
        grpo.load_state_dict(state)
    if collectives.world_rank_and_size()[0] == 0:  # a new list: Lightning's stays as it was
        jsonl = MetricsJsonl(Path(log_dir) / "metrics.jsonl", resume_step=grpo.step)
        logger.loggers = [*logger.loggers, jsonl]
    grpo.fit()
    if run_timer.requested and grpo.step < grpo.max_steps:  # checkpointed: requeue to continue
        if collectives.world_rank_and_size()[0] == 0:
            mark_preempted(log_dir, grpo.step)
        print(f"[train_grpo] preempted after step {grpo.step}: checkpoint saved in {log_dir}")
        raise SystemExit(PREEMPTED_EXIT_CODE)


def main() -> None:
    if not torch.cuda.is_available():
        # The CPU route (tests, scripts/nemo_demo.sh): NeMo 2.1 without GPU, apex, TE, TRT-LLM.
        from megatron_ba.integrations.nemo_aligner import cpu_shims

        print(f"[train_grpo] no CUDA device: {len(cpu_shims.install())} CPU shims installed")
    from nemo.core.config import hydra_runner

    hydra_runner(config_path="conf", config_name="gpt_grpo_balanced")(_main)()


if __name__ == "__main__":
    main()
