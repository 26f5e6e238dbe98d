"""The engines' table: how the model is laid out and its rollouts generated (`parallel.*`,
`rollout.*`).

verl and NeMo-RL lay out megatron-core themselves from these sizes and generate with vLLM;
NeMo-Aligner's actor has tensor and pipeline parallelism only and generates with the policy's
own layout, so the local backend's vLLM settings have no counterpart there.
"""

from __future__ import annotations

from megatron_ba.integrations.engines.cells import ROW, Absent, Dropped, Need, Put, Row, Set, put
from megatron_ba.integrations.engines.data_rows import data_parallel
from megatron_ba.integrations.engines.loss_rows import step_sequences
from megatron_ba.integrations.engines.model_rows import GEN, MC, A, M, R

VLLM = f"{GEN}.vllm_cfg"
OVER = f"{M}.override_transformer_config"  # verl's transformer config settings


def _asynchronous(job) -> bool:
    return job.rollout.max_staleness > 0


LOCAL_VLLM = "the local backend's vLLM engine's (NeMo-Aligner generates without vLLM)"
NEMO_GENERATES = "NeMo-Aligner's loop generates with the policy's own layout"


def _budget(job) -> bool:
    """Token-budget micro-batches (dynamic batch sizes) in place of sequence counts."""
    return job.parallel.max_tokens_per_microbatch is not None


def _recomputes(job) -> bool:
    return job.parallel.recompute != "none"


def _full(job) -> bool:
    return job.parallel.recompute == "full"


def _local_only_size(key: str) -> Absent:
    """NeMo-Aligner's refusal of a size only the local backend's actor has."""
    return Absent(
        "the local backend's (NeMo-Aligner's actor micro-batches by sequences and "
        "computes its own log-probs)",
        said=lambda j: (
            f"parallel.{key}: not available on the nemo_aligner backend, "
            f"got {getattr(j.parallel, key)}; use null (the local backend has it)"
        ),
    )


def _stage_row(key: str) -> Row:
    """An uneven pipeline stage's layers (megatron-core's num_layers_in_{first,last}_pipeline_
    stage): verl passes it through its transformer config overrides (a key its config lacks:
    added with hydra's `+`), NeMo-RL has the key."""
    config_key = f"num_layers_in_{key.split('_')[1]}_pipeline_stage"
    return Row(
        put(Set(f"+{OVER}.{config_key}", when=lambda j: getattr(j.parallel, key) is not None)),
        put(f"{MC}.{config_key}"),
        Absent(
            "uneven pipeline stages are the local backend's (not translated to NeMo-Aligner)",
            said=lambda j: (
                f"parallel.{key}: uneven pipeline stages are not translated to NeMo-Aligner, "
                f"got {getattr(j.parallel, key)}; use null (even stages)"
            ),
        ),
    )


def _no_experts(key: str) -> Absent:
    return Absent(
        "expert parallelism is the local backend's (not translated to NeMo-Aligner)",
        said=lambda j: (
            f"parallel.{key}: expert parallelism is the local backend's "
            f"(not translated to NeMo-Aligner), got {getattr(j.parallel, key)}"
        ),
    )


ROWS: dict[str, Row] = {
    "parallel.tp": Row(
        put(f"{M}.tensor_model_parallel_size"),
        put(f"{MC}.tensor_model_parallel_size"),
        put("model.tensor_model_parallel_size"),
    ),
    "parallel.pp": Row(
        put(f"{M}.pipeline_model_parallel_size"),
        put(f"{MC}.pipeline_model_parallel_size"),
        put("model.pipeline_model_parallel_size"),
    ),
    "parallel.pp_first_stage_layers": _stage_row("pp_first_stage_layers"),
    "parallel.pp_last_stage_layers": _stage_row("pp_last_stage_layers"),
    "parallel.cp": Row(
        put(f"{M}.context_parallel_size"),
        put(f"{MC}.context_parallel_size"),
        Absent(
            "NeMo-Aligner's actor has no context parallelism",
            said=lambda j: (
                "parallel.cp: NeMo-Aligner's actor has no context parallelism, "
                f"got cp={j.parallel.cp}"
            ),
        ),
    ),
    "parallel.ep": Row(
        put(f"{M}.expert_model_parallel_size", note="the reference model's follows it"),
        put(f"{MC}.expert_model_parallel_size"),
        _no_experts("ep"),
    ),
    "parallel.etp": Row(
        put(f"{M}.expert_tensor_parallel_size", note="null: megatron-core's default, tp"),
        put(
            Set(
                f"{MC}.expert_tensor_parallel_size",
                lambda j: j.layout.expert_tp,
            ),
            note="null: parallel.tp, megatron-core's default; NeMo-RL's own default is 1",
        ),
        _no_experts("etp"),
    ),
    "parallel.micro_batch_size": Row(
        put(
            *(
                Set(k, when=lambda j: not _budget(j))
                for k in (
                    f"{A}.ppo_micro_batch_size_per_gpu",
                    f"{R}.log_prob_micro_batch_size_per_gpu",
                    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                )
            )
        ),
        put(
            "policy.train_micro_batch_size",
            note="policy.logprob_batch_size follows it; NeMo-RL's sequence packing: micro-batches "
            "of micro_batch_size x max_total_sequence_length tokens",
        ),
        put(
            "model.micro_batch_size",
            "model.reinforce.forward_micro_batch_size",
            "trainer.reinforce.model_mbs",
            need=Need(
                lambda j: step_sequences(j) % (data_parallel(j) * j.parallel.micro_batch_size) == 0,
                lambda j: (
                    f"{step_sequences(j)} sequences per optimizer step do not "
                    f"split into micro-batches of {j.parallel.micro_batch_size} on "
                    f"{data_parallel(j)} DP ranks"
                ),
            ),
        ),
    ),
    "parallel.max_tokens_per_microbatch": Row(
        put(
            Set(f"{A}.use_dynamic_bsz", True, when=_budget),
            Set(f"{A}.ppo_max_token_len_per_gpu", when=_budget),
        ),
        put(
            Set("policy.sequence_packing.train_mb_tokens", when=_budget),
            Set("policy.sequence_packing.logprob_mb_tokens", when=_budget),
        ),
        _local_only_size("max_tokens_per_microbatch"),
    ),
    "parallel.logprob_chunk_size": Row(
        Absent("the local backend's vocab-parallel log-softmax"),
        Absent(
            "the local backend's vocab-parallel log-softmax (not translated to NeMo-RL's "
            "policy.logprob_chunk_size)"
        ),
        _local_only_size("logprob_chunk_size"),
    ),
    "parallel.sequence_parallel": Row(
        put(f"{M}.sequence_parallel", "actor_rollout_ref.ref.megatron.sequence_parallel"),
        put(f"{MC}.sequence_parallel"),
        put("model.sequence_parallel"),
    ),
    "parallel.recompute": Row(
        Put(
            (
                Set(f"{OVER}.recompute_granularity", when=_recomputes),
                Set(f"{OVER}.recompute_method", "uniform", when=_full),
                Set(f"{OVER}.recompute_num_layers", 1, when=_full),
            ),
            doc=f"{OVER}.recompute_granularity (full: {OVER}.recompute_method=uniform, "
            f"{OVER}.recompute_num_layers=1)",
        ),
        Put(
            (
                Set(f"{MC}.activation_checkpointing", _recomputes),
                Set(f"{MC}.recompute_granularity", when=_recomputes),
            ),
            doc=f"{MC}.activation_checkpointing (none: false), {MC}.recompute_granularity (full / "
            "selective: core attention)",
        ),
        put(
            Set(
                "model.activations_checkpoint_granularity",
                lambda j: j.parallel.recompute if _recomputes(j) else None,
            ),
            Set("model.activations_checkpoint_method", lambda j: "uniform" if _full(j) else None),
            Set("model.activations_checkpoint_num_layers", lambda j: 1 if _full(j) else None),
            note="selective: core attention; full: uniform over blocks of one layer",
        ),
    ),
    "rollout.engine": Row(
        put(
            Set(f"{R}.name", "vllm"),
            note="builtin refused",
            need=Need(
                lambda j: j.rollout.engine == "vllm",
                lambda j: f"verl's rollout here is vllm, got {j.rollout.engine!r}",
            ),
        ),
        put(
            Set(f"{GEN}.backend", "vllm"),
            note="builtin refused",
            need=Need(
                lambda j: j.rollout.engine == "vllm",
                lambda j: f"NeMo-RL's rollout here is vllm, got {j.rollout.engine!r}",
            ),
        ),
        Dropped(NEMO_GENERATES),
    ),
    "rollout.in_process": Row(
        Absent("the local backend's engine placement (verl places its own)"),
        Absent("the local backend's engine placement (NeMo-RL places its own)"),
        Dropped("the local backend's engine placement (NeMo-Aligner generates in its actor)"),
    ),
    "rollout.kv_cache_gb": Row(
        Absent("vLLM's CPU KV cache (verl runs on GPUs)"),
        Absent("vLLM's CPU KV cache (NeMo-RL runs vLLM on GPUs)"),
        Dropped(LOCAL_VLLM),
    ),
    "rollout.threads": Row(
        Absent("the local trainer's torch threads"),
        Absent("the local trainer's torch threads"),
        Dropped("the local trainer's torch threads"),
    ),
    "rollout.refit_bucket_mb": Row(
        Absent("the local backend's refit (verl syncs weights itself)"),
        Absent("the local backend's refit (NeMo-RL refits weights itself)"),
        Dropped(LOCAL_VLLM),
    ),
    "rollout.routing_replay": Row(
        Absent("the local backend's MoE routing replay (not translated to verl)"),
        Absent("the local backend's MoE routing replay (not translated to NeMo-RL)"),
        Absent("the local backend's MoE routing replay (not translated to NeMo-Aligner)"),
    ),
    "rollout.max_staleness": Row(
        Absent(
            "verl's asynchronous trainers split the GPUs between rollout and training: run "
            "python -m megatron_ba.integrations.verl.one_step_off_policy or fully_async_policy"
        ),
        Put(
            tuple(
                Set(key, value, when=_asynchronous)
                for key, value in (
                    ("grpo.async_grpo.enabled", True),
                    ("grpo.async_grpo.max_trajectory_age_steps", ROW),
                    (f"{VLLM}.async_engine", True),
                    ("loss_fn.use_importance_sampling_correction", True),
                )
            ),
            doc="K > 0: grpo.async_grpo.enabled=true, grpo.async_grpo.max_trajectory_age_steps=K "
            f"(NeMo-RL's async_grpo_train), {VLLM}.async_engine=true and "
            "loss_fn.use_importance_sampling_correction=true (both required by it); 0: grpo_train",
        ),
        Absent("NeMo-Aligner's GRPO loop is synchronous"),
    ),
    "rollout.sync_every": Row(
        Absent("the local backend's asynchronous schedule (not translated to verl)"),
        Absent("NeMo-RL refits after every step; grpo.async_grpo.max_trajectory_age_steps bounds"),
        Absent("NeMo-Aligner's GRPO loop is synchronous"),
    ),
    "rollout.engine_cores": Row(
        Absent("the local backend's CPU placement (verl places its own)"),
        Absent("the local backend's CPU placement (NeMo-RL places its own)"),
        Absent("NeMo-Aligner's GRPO loop is synchronous"),
    ),
    "rollout.engine_tp": Row(
        put(f"{R}.tensor_model_parallel_size"),
        put(f"{VLLM}.tensor_parallel_size"),
        Dropped(NEMO_GENERATES),
    ),
    "rollout.sleep": Row(
        put(f"{R}.free_cache_engine"),
        Put(
            (Set(f"{GEN}.colocated.enabled", True),),
            (
                Need(
                    lambda j: j.rollout.sleep,
                    "NeMo-RL's colocated vLLM always frees its memory "
                    "while the policy trains; set true",
                ),
            ),
            doc=f"true only: {GEN}.colocated.enabled=true (NeMo-RL's colocated vLLM frees its "
            "memory while the policy trains)",
        ),
        Dropped(NEMO_GENERATES),
    ),
    "rollout.gpu_memory_utilization": Row(
        put(f"{R}.gpu_memory_utilization"),
        put(f"{VLLM}.gpu_memory_utilization"),
        Dropped(NEMO_GENERATES),
    ),
    "rollout.dtype": Row(
        put(
            Set(
                f"{R}.dtype", lambda j: "bfloat16" if j.rollout.dtype == "auto" else j.rollout.dtype
            ),
            note="auto: bfloat16",
        ),
        Put(
            needs=(
                Need(
                    lambda j: j.rollout.dtype in ("auto", "bfloat16"),
                    lambda j: (
                        "vLLM follows policy.precision (bfloat16) under NeMo-RL, got "
                        f"{j.rollout.dtype!r}"
                    ),
                ),
            ),
            doc=f"auto / bfloat16 ({VLLM}.precision follows policy.precision); float32 refused",
        ),
        Dropped(NEMO_GENERATES),
    ),
}
