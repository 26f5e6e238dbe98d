"""The engines' table: how the run is optimised, kept and logged (`optimizer.*`, `checkpoint.*`,
`logging.*`), and the options of `megatron-ba train` an engine reads (`--nodes`, `--devices`,
`--accelerator`, `--run-dir`).
"""

from __future__ import annotations

from megatron_ba.integrations.engines.cells import REMOVE, Absent, Dropped, Need, Put, Row, Set, put
from megatron_ba.integrations.engines.model_rows import MC, A

OPT, SCHED = f"{MC}.optimizer", f"{MC}.scheduler"
# The keys of NeMo-Aligner's model.optim that only apex's distributed_fused_adam takes: a CPU run
# (torch's AdamW) removes them.
APEX_ADAM_KEYS = ("bucket_cap_mb", "overlap_grad_sync", "contiguous_grad_buffer")
WANDB_OFF = "NeMo's exp_manager keeps its config's wandb logger off (create_wandb_logger)"


def _on_cpu(job) -> bool:
    return job.accelerator == "cpu"


def _logger(job) -> list[str]:
    """verl's trainer.logger: the console, and tensorboard and wandb where the recipe has them."""
    logging = job.logging
    return [
        "console",
        *(["tensorboard"] if logging.tensorboard else []),
        *(["wandb"] if logging.wandb.mode == "online" else []),
    ]


def _at_least_one(key: str, why: str = "must be >= 1") -> Need:
    option = "nodes" if key == "nodes" else "devices"
    return Need(
        lambda j: isinstance(j.value(f"--{option}"), int) and j.value(f"--{option}") >= 1,
        lambda j: f"{why}, got {j.value(f'--{option}')!r}",
        key=key,
    )


def _world_splits(job) -> bool:
    return job.nodes * job.devices % (job.parallel.tp * job.parallel.pp) == 0


ROWS: dict[str, Row] = {
    "optimizer.lr": Row(
        put(f"{A}.optim.lr"),
        put(f"{OPT}.lr", f"{OPT}.min_lr", note="constant after warm-up"),
        put("model.optim.lr"),
    ),
    # Written as attribute reads (not the row's value by its dotted name): the local trainer
    # hands these sections on whole, so these are the code's named reads of the keys
    # (tests/test_recipe.py finds them statically).
    "optimizer.weight_decay": Row(
        put(Set(f"{A}.optim.weight_decay", lambda j: j.optimizer.weight_decay)),
        put(Set(f"{OPT}.weight_decay", lambda j: j.optimizer.weight_decay)),
        put(Set("model.optim.weight_decay", lambda j: j.optimizer.weight_decay)),
    ),
    "optimizer.beta1": Row(
        put(Set(f"{A}.optim.betas", lambda j: [j.optimizer.beta1, j.optimizer.beta2])),
        put(f"{OPT}.adam_beta1"),
        put(Set("model.optim.betas", lambda j: f"[{j.optimizer.beta1},{j.optimizer.beta2}]")),
    ),
    "optimizer.beta2": Row(
        Put(doc=f"{A}.optim.betas"), put(f"{OPT}.adam_beta2"), Put(doc="model.optim.betas")
    ),
    "optimizer.eps": Row(
        Absent("verl's megatron optimizer config has no eps (megatron-core's Adam: 1e-8)"),
        put(Set(f"{OPT}.adam_eps", lambda j: j.optimizer.eps)),  # an attribute read, as above
        put(Set("model.optim.eps", lambda j: j.optimizer.eps)),
    ),
    "optimizer.grad_clip": Row(  # attribute reads, as above
        put(Set(f"{A}.optim.clip_grad", lambda j: j.optimizer.grad_clip)),
        put(Set("policy.max_grad_norm", lambda j: j.optimizer.grad_clip)),
        put(Set("trainer.reinforce.gradient_clip_val", lambda j: j.optimizer.grad_clip)),
    ),
    "optimizer.warmup_steps": Row(
        put(f"{A}.optim.lr_warmup_steps"),
        Put(
            (
                Set(f"{SCHED}.lr_warmup_iters"),
                Set(f"{SCHED}.lr_warmup_init", 0.0),
                Set(f"{SCHED}.lr_decay_style", "constant"),
                Set(f"{SCHED}.lr_decay_iters", lambda j: j.grpo.steps),
            ),
            doc=f"{SCHED}.lr_warmup_iters ({SCHED}.lr_warmup_init=0, {SCHED}.lr_decay_style="
            f"constant, {SCHED}.lr_decay_iters = grpo.steps)",
        ),
        Dropped("not written yet: model.optim.sched.warmup_steps stays the config's 0"),
    ),
    "checkpoint.every": Row(
        put(
            Set(
                "trainer.save_freq",
                lambda j: j.checkpoint.every or j.grpo.steps,
                note="0: grpo.steps",
            ),
            Set("trainer.resume_mode", "auto"),
        ),
        put(
            Set(
                "checkpointing.save_period",
                lambda j: j.checkpoint.every or j.grpo.steps,
                note="0: grpo.steps",
            ),
            Set("checkpointing.enabled", True),
            note="NeMo-RL resumes from its latest",
        ),
        put(
            Set(
                "trainer.reinforce.save_interval",
                lambda j: j.checkpoint.every or j.grpo.steps,
                note="0: grpo.steps; a multiple of eval.every",
            ),
            need=Need(
                lambda j: (
                    (j.checkpoint.every or j.grpo.steps) % (j.eval.every or j.grpo.steps) == 0
                ),
                lambda j: (
                    "NeMo-Aligner checkpoints only on evaluation steps; "
                    f"checkpoint.every ({j.checkpoint.every or j.grpo.steps}) must be a multiple "
                    f"of eval.every ({j.eval.every or j.grpo.steps}; 0 means grpo.steps = "
                    f"{j.grpo.steps})"
                ),
            ),
        ),
    ),
    "checkpoint.keep": Row(
        put("trainer.max_actor_ckpt_to_keep"),
        put(
            "checkpointing.keep_top_k",
            Set("checkpointing.metric_name", None, note="the latest, not the best by a metric"),
        ),
        Dropped("not written yet: NeMo's checkpoint callback keeps the config's save_top_k (1)"),
    ),
    "logging.progress": Row(
        Dropped("this project's console display (verl logs through `trainer.logger`)"),
        Dropped("this project's console display (NeMo-RL logs through `logger`)"),
        Dropped("this project's console display (NeMo-Aligner logs through NeMo's loggers)"),
    ),
    "logging.plots": Row(
        Dropped("this project's console display (verl logs through `trainer.logger`)"),
        Dropped("this project's console display (NeMo-RL logs through `logger`)"),
        Dropped("this project's console display (NeMo-Aligner logs through NeMo's loggers)"),
    ),
    "logging.tensorboard": Row(
        Put((Set("trainer.logger", _logger),), doc="trainer.logger += tensorboard"),
        put("logger.tensorboard_enabled"),
        Dropped("NeMo's exp_manager writes its config's tensorboard events"),
    ),
    "logging.wandb.mode": Row(
        Put(
            needs=(
                Need(
                    lambda j: j.logging.wandb.mode != "offline",
                    "verl's trainer.logger has wandb online only; use online or disabled",
                ),
            ),
            doc="online: trainer.logger += wandb; offline refused",
        ),
        Put(
            (Set("logger.wandb_enabled", lambda j: j.logging.wandb.mode == "online"),),
            (
                Need(
                    lambda j: j.logging.wandb.mode != "offline",
                    "NeMo-RL's logger has wandb online only; use online or disabled",
                ),
            ),
            doc="online: logger.wandb_enabled=true; offline refused",
        ),
        Dropped(WANDB_OFF),
    ),
    "logging.wandb.project": Row(
        put(
            Set("trainer.project_name", lambda j: j.logging.wandb.project or "megatron-ba"),
            note="default megatron-ba",
        ),
        put(
            Set("logger.wandb.project", lambda j: j.logging.wandb.project or "megatron-ba"),
            note="default megatron-ba",
        ),
        Dropped(WANDB_OFF),
    ),
    "logging.wandb.entity": Row(
        Absent("verl's trainer has no key for it (set WANDB_ENTITY)"),
        Absent("NeMo-RL's logger has no key for it (set WANDB_ENTITY)"),
        Dropped(WANDB_OFF),
    ),
}

# The options of `megatron-ba train` an engine reads.
OPTION_ROWS: dict[str, Row] = {
    "--nodes": Row(
        put("trainer.nnodes", need=_at_least_one("nodes")),
        put("cluster.num_nodes", need=_at_least_one("nodes")),
        put("trainer.num_nodes", need=_at_least_one("num_nodes", "must be an integer >= 1")),
    ),
    "--devices": Row(
        put("trainer.n_gpus_per_node", note="default 8", need=_at_least_one("gpus_per_node")),
        put("cluster.gpus_per_node", note="default 8", need=_at_least_one("gpus_per_node")),
        put(
            "trainer.devices",
            note="default TP x PP: one data-parallel replica per node; DP = "
            "nodes x devices / (TP x PP)",
            need=Need(
                _world_splits,
                lambda j: (
                    f"num_nodes x devices = {j.nodes * j.devices} is "
                    f"not a multiple of TP x PP = {j.parallel.tp * j.parallel.pp}"
                ),
                key="devices",
            ),
        ),
    ),
    "--accelerator": Row(
        Dropped("NeMo-Aligner's option (verl runs on GPU nodes)"),
        Dropped("NeMo-Aligner's option (NeMo-RL runs on GPU nodes)"),
        put(
            "trainer.accelerator",
            Set("model.optim.name", "adamw", when=_on_cpu),
            Set("model.reinforce.offload_adam_states", False, when=_on_cpu),
            *(Set(f"model.optim.{k}", REMOVE, when=_on_cpu) for k in APEX_ADAM_KEYS),
            note="auto: gpu where torch sees one; cpu: fp32 with torch's AdamW (apex's Adam and "
            "its keys need a GPU)",
            need=Need(
                lambda j: j.accelerator in ("gpu", "cpu"),
                lambda j: f"must be gpu or cpu, got {j.accelerator!r}",
                key="accelerator",
            ),
        ),
    ),
    "--run-dir": Row(
        put(
            Set(
                "trainer.default_local_dir",
                lambda j: f"{j.run_dir}/checkpoints",
                when=lambda j: j.run_dir is not None,
            ),
            note="absolute",
        ),
        put(
            Set(
                "checkpointing.checkpoint_dir",
                lambda j: f"{j.run_dir}/checkpoints",
                when=lambda j: j.run_dir is not None,
            ),
            Set(
                "logger.log_dir",
                lambda j: f"{j.run_dir}/logs",
                when=lambda j: j.run_dir is not None,
            ),
            note="absolute",
        ),
        put(
            Set(
                "model.data.data_prefix.train",
                lambda j: j.prompt_files[0],
                when=lambda j: j.prompt_files is not None,
            ),
            Set(
                "model.data.data_prefix.validation",
                lambda j: j.prompt_files[1],
                when=lambda j: j.prompt_files is not None,
            ),
            Set("exp_manager.explicit_log_dir", when=lambda j: j.run_dir is not None),
            note="the prompt files RUN_DIR/data/{train,val}.jsonl; NeMo's log folder, where it "
            "resumes",
        ),
    ),
}
