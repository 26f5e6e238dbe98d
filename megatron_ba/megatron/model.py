"""A Qwen2-shaped megatron-core GPTModel (its deterministic full-shape initial weights:
megatron_ba.megatron.full_weights, re-exported here).

    spec = ModelSpec.of(PRESETS["debug"])           # a model_shape preset, a ModelShape, or
                                                     # conversion.spec_from_hf_config(cfg)
    # after torch.distributed and parallel_state.initialize_model_parallel(tp, pp, ...)
    chunks = build_model_chunks(spec)                # [DDP(GPTModel)] for this rank's stage
    load_full_state_dict(chunks, full_init_state_dict(spec, seed=0))  # parallel.full_shape

The architecture is megatron_ba.model_shape's (Qwen2 / Qwen3 / Qwen3-MoE; RoPE not interleaved,
or YaRN: megatron_ba.megatron.rope; MoE layers: `moe_config_fields`, `moe_layer_spec`).
By default it is built from megatron-core's `get_gpt_layer_local_spec()` (no Transformer Engine),
so it runs on CPU with megatron_ba.megatron.cpu_compat installed; on GPUs pass a Transformer Engine
layer spec (`layer_spec=`) for fused kernels and context-parallel attention
(megatron_ba.megatron.build_options chooses the spec, precision, SP, recomputation and the
model's CP from the recipe; `check_cp_agreement` refuses a batch sharded unlike the model).

Full-shape state dicts use megatron-core's own names at TP=1 / PP=1 (`embedding.word_embeddings.
weight`, `decoder.layers.{i}.self_attention.linear_qkv.weight`, ..., `output_layer.weight`), with
global layer numbers and megatron's fused layouts (QKV rows grouped per query group: for each
group, its q heads then one k and one v head; `linear_fc1` = [gate; up]). Converting these names
and layouts to Hugging Face Qwen2 is the caller's business. Moving full-shape tensors in and out
of this rank's shards is megatron_ba.parallel.full_shape's (it knows no architecture).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any

import torch

from megatron_ba.megatron import cpu_compat, hybrid, rope
from megatron_ba.megatron.full_weights import (
    full_init_state_dict as full_init_state_dict,  # re-exported
)
from megatron_ba.megatron.full_weights import full_parameter_shapes
from megatron_ba.model_shape import PRESETS, ModelShape
from megatron_ba.parallel import collectives
from megatron_ba.parallel.full_shape import unwrap
from megatron_ba.parallel.parallel_layout import ParallelLayout


@dataclass(frozen=True)
class ModelSpec(ModelShape):
    """A model shape (megatron_ba.model_shape.ModelShape: its fields, checks and parameter
    counts) with what only building it needs: the parameters' dtype, the initialisation's
    standard deviation and megatron-core TransformerConfig overrides.

    Build one from a shape with `ModelSpec.of(PRESETS["debug"])`, from a Hugging Face
    config.json with megatron_ba.conversion.spec_from_hf_config.
    """

    init_std: float = 0.02
    params_dtype: torch.dtype = torch.float32
    config_overrides: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, shape: ModelShape, **changes: Any) -> ModelSpec:
        """The spec of `shape`, with `changes` to its fields or the build options."""
        fields = {f.name: getattr(shape, f.name) for f in dataclass_fields(ModelShape)}
        return cls(**{**fields, **changes})

    def num_parameters(self) -> int:
        return sum(math.prod(s) for s in full_parameter_shapes(self).values())


def tiny_qwen2_spec(**changes: Any) -> ModelSpec:
    """The "debug" preset's model (~60k parameters: multi-process CPU tests), with `changes`."""
    return ModelSpec.of(PRESETS["debug"], **changes)


# The layout's uneven pipeline stages as megatron-core's TransformerConfig names them.
STAGE_CONFIG_FIELDS = {
    "pp_first_stage_layers": "num_layers_in_first_pipeline_stage",
    "pp_last_stage_layers": "num_layers_in_last_pipeline_stage",
}


def stage_config_fields(layout: ParallelLayout) -> dict[str, int]:
    """TransformerConfig fields of `layout`'s uneven pipeline stages (none when even)."""
    return {
        config_name: getattr(layout, name)
        for name, config_name in STAGE_CONFIG_FIELDS.items()
        if getattr(layout, name) is not None
    }


def transformer_config(spec: ModelSpec, *, cpu: bool | None = None, **overrides: Any):
    """megatron-core TransformerConfig of `spec` for the parallel layout now initialised (its
    uneven pipeline stages, if any, in `overrides`: stage_config_fields)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    if cpu is None:
        cpu = not torch.cuda.is_available()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    stages = {name: overrides.get(field) for name, field in STAGE_CONFIG_FIELDS.items()}
    ParallelLayout(tp=tp, pp=pp, dp=None, **stages).check_model(spec)
    kwargs: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=spec.init_std,
        params_dtype=spec.params_dtype,
        pipeline_dtype=spec.params_dtype,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        # By default the model runs no CP attention itself: under CP the caller shards at the
        # loss (local spec, CPU); a Transformer Engine build passes context_parallel_size=cp
        # (build_options.BuildOptions.config_fields) and gets CP-sharded inputs.
        context_parallel_size=1,
        sequence_parallel=False,
    )
    if cpu:
        cpu_compat.install()
        kwargs.update(cpu_compat.CPU_CONFIG_OVERRIDES)
        if overrides.get("sequence_parallel"):
            cpu_compat.install_sequence_parallel()  # the local spec's norms under SP (shim 6)
    if spec.num_experts:
        if cpu:
            cpu_compat.install_moe()
        kwargs.update(moe_config_fields(spec, cpu=cpu))
    kwargs.update(hybrid.hybrid_config_fields(spec))
    if cpu and spec.has_linear_attention:
        cpu_compat.install_gated_delta_net()
        kwargs["deterministic_mode"] = True  # the DeltaNet's torch conv1d and delta rule
    kwargs.update(rope.config_defaults(spec))
    kwargs.update(spec.config_overrides)
    kwargs.update(overrides)
    config = TransformerConfig(**kwargs)
    rope.set_yarn_fields(config, spec)
    return config


def moe_config_fields(spec: ModelSpec, *, cpu: bool) -> dict[str, Any]:
    """TransformerConfig fields of a mixture-of-experts spec, routed as Hugging Face Qwen3-MoE.

    HF routes with a softmax over all experts, then top-k; `norm_topk_prob` divides the k
    weights by their sum, which equals a softmax over the k largest logits: megatron-core's
    `moe_router_pre_softmax=False` (top-k, then softmax). Without renormalisation the weights
    are the full softmax's top k: `moe_router_pre_softmax=True`. Both are checked against HF's
    logits in tests/test_moe_model.py. CPU: SequentialMLP experts and the allgather dispatcher
    (cpu_compat shim 3); GPUs: Transformer Engine grouped GEMM and the alltoall dispatcher.
    """
    return dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_router_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_layer_freq=[int(spec.is_moe_layer(i)) for i in range(spec.num_layers)],
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not spec.moe_norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if spec.moe_aux_loss_coeff else "none",
        moe_aux_loss_coeff=spec.moe_aux_loss_coeff,
        moe_token_dispatcher_type="allgather" if cpu else "alltoall",
        moe_grouped_gemm=not cpu,
    )


def moe_layer_spec(config, *, transformer_engine: bool = False):
    """megatron-core's decoder block spec for a MoE config: its `moe_layer_freq` pattern of
    expert and dense layers, RMSNorm, q/k norms as the config says. transformer_engine=False:
    local modules and SequentialMLP experts (CPU; what the conversion tables name);
    True: Transformer Engine modules, grouped-GEMM experts when `config.moe_grouped_gemm`
    (GPUs; untested here)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(
        config, use_transformer_engine=transformer_engine, normalization="RMSNorm"
    )


def _check_moe_layer_spec(layer_spec) -> None:
    """ValueError for a one-layer spec whose MLP is dense: megatron-core would build a dense
    model from it whatever `num_moe_experts` says (a block spec from `moe_layer_spec` is
    accepted as it is; it follows the config's pattern)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    if not isinstance(layer_spec, ModuleSpec):
        return
    mlp = getattr(layer_spec.submodules, "mlp", None)
    # a ModuleSpec up to megatron-core 0.16, a functools.partial of the class from 0.19
    built = getattr(mlp, "module", None) or getattr(mlp, "func", None)
    if built is not MoELayer:
        raise ValueError(
            "layer_spec: a dense layer spec for a mixture-of-experts spec (num_experts > 0); "
            "pass moe_layer_spec(config, transformer_engine=...) or leave it unset"
        )


def local_layer_spec(qk_layernorm: bool = False):
    """megatron-core's Transformer-Engine-free layer spec with RMSNorm (runs on CPU).

    `get_gpt_layer_local_spec(normalization=...)` exists from megatron-core 0.11 on; older
    versions' local spec has no RMSNorm: pass a Transformer Engine spec as `layer_spec` there
    (e.g. `get_gpt_layer_with_transformer_engine_spec()`, also what GPUs want for CP attention).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    try:
        return get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)
    except TypeError as e:
        raise ValueError(
            "layer_spec: this megatron-core's local layer spec has no RMSNorm; pass a Transformer "
            "Engine layer spec (get_gpt_layer_with_transformer_engine_spec())"
        ) from e


def build_gpt_model(
    spec: ModelSpec, config=None, *, layer_spec=None, pg_collection=None, vp_stage=None
):
    """This rank's pipeline stage of the model (not wrapped in DDP).

    layer_spec: a megatron-core ModuleSpec for the transformer layers; default `local_layer_spec()`
    (with q/k layernorms when the spec has them), or for a MoE spec `moe_layer_spec(config)`.
    A Transformer Engine spec must be built with the same `qk_layernorm`.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = config if config is not None else transformer_config(spec)
    if layer_spec is None and hybrid.is_hybrid(spec):
        layer_spec = hybrid.hybrid_block_spec(config, spec)
    elif layer_spec is None:
        layer_spec = (
            moe_layer_spec(config) if spec.num_experts else local_layer_spec(spec.qk_layernorm)
        )
    elif spec.num_experts:
        _check_moe_layer_spec(layer_spec)
    rope.set_yarn_fields(config, spec)  # a config built elsewhere
    rope.check_cp(spec, pg_collection)
    kwargs: dict[str, Any] = {}
    if pg_collection is not None:  # megatron-core >= 0.14 only
        kwargs["pg_collection"] = pg_collection
    if vp_stage is not None:
        kwargs["vp_stage"] = vp_stage
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,  # logits stay vocab-sharded: log-probs are vocab-parallel
        # Tied: at PP > 1 the last stage holds a copy of the embedding that megatron-core
        # all-reduces at build time with `.cuda()` (0.16.1): tied models need PP=1 on CPU.
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        **rope.gpt_model_kwargs(spec),
        **kwargs,
    )
    if spec.has_linear_attention:
        hybrid.mark_tp_sections(model)
    return model


def build_model_chunks(
    spec: ModelSpec,
    *,
    ddp: bool = True,
    config=None,
    layer_spec=None,
    pg_collection=None,
    ddp_config_overrides: dict[str, Any] | None = None,
) -> list[torch.nn.Module]:
    """[model] for this rank, wrapped in megatron-core's DistributedDataParallel by default.

    A list because megatron-core's schedules take model chunks (one per virtual pipeline stage;
    this builder makes one). DDP keeps gradients in `param.main_grad` and reduces them over the
    data(-and-context)-parallel group in `finalize_model_grads`; the schedule sets that up via
    `config.finalize_model_grads_func` (megatron_ba.megatron.grpo_step does).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = config if config is not None else transformer_config(spec)
    model = build_gpt_model(spec, config, layer_spec=layer_spec, pg_collection=pg_collection)
    if config.bf16 or config.fp16:
        # megatron-core's mixed-precision wrapper: casts the module to bf16 (config.params_dtype
        # already is) and the last stage's output back to fp32, as Megatron-LM wraps its model
        # before DDP; the optimiser keeps the fp32 main weights (optimizer_choice).
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    if not ddp:
        return [model]
    ddp_kwargs: dict[str, Any] = dict(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=False,
    )
    ddp_kwargs.update(ddp_config_overrides or {})
    wrapped = DistributedDataParallel(
        config=config, ddp_config=DistributedDataParallelConfig(**ddp_kwargs), module=model
    )
    return [wrapped]


def model_pg_collection_without_cp():
    """Process groups for a model that sees whole sequences while parallel_state has CP > 1.

    megatron-core's attention cannot run context parallelism on CPU (it needs Transformer
    Engine), so CPU checks of CP run the model on whole sequences and shard at the loss
    (grpo_step's cp_mode="loss"). The model must then not slice its rotary embedding by CP rank:
    it gets megatron-core's default groups with `cp` replaced by a group of this rank alone.
    Returns None when CP is 1 (use the defaults). Collective: every rank calls it.
    megatron-core >= 0.14 (models take `pg_collection`).
    """
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    if parallel_state.get_context_parallel_world_size() == 1:
        return None
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    pgs.cp = collectives.singleton_group()
    return pgs


def model_cp_size(chunk: torch.nn.Module) -> int:
    """The CP size a built model runs itself: its CP process group's size (megatron-core's
    rotary embedding and CP attention shard by that group). 1 when it has none."""
    model = unwrap(chunk)
    pgs = getattr(model, "pg_collection", None)
    group = getattr(pgs, "cp", None) if pgs is not None else None
    return 1 if group is None else collectives.group_rank_and_size(group)[1]


def check_cp_agreement(chunks: list[torch.nn.Module], cp_view_mode: str, cp_size: int) -> None:
    """ValueError unless the model's CP and the batch's CP sharding agree.

    cp_view_mode / cp_size: how the step shards the batch (grpo_step's CPView mode and the
    parallel state's CP size). "model": every CP rank gets 1/cp_size of each sequence, so the
    model must run CP attention over cp_size ranks (built with context_parallel_size = cp_size,
    its CP group that size). "loss": the model gets whole sequences, so it must run no CP (its
    CP group this rank alone: model_pg_collection_without_cp). At cp_size 1 both are trivial.
    A disagreement is silently wrong attention (each shard attending to itself alone, or a
    rotary embedding sliced by a CP rank that sees the whole sequence).
    """
    for chunk in chunks:
        model = unwrap(chunk)
        built = model_cp_size(chunk)
        config_cp = int(getattr(getattr(model, "config", None), "context_parallel_size", 1))
        if built != config_cp:
            raise ValueError(
                f"chunks: the model's CP group has {built} ranks but its TransformerConfig says "
                f"context_parallel_size={config_cp}; build both with the same CP size"
            )
        want = cp_size if cp_view_mode == "model" else 1
        if built != want:
            shards = (
                f"sharded {cp_size} ways (cp_mode 'model')"
                if cp_view_mode == "model"
                else "as whole sequences (cp_mode 'loss')"
            )
            raise ValueError(
                f"cp_mode: the batch reaches the model {shards}, but the model was built with "
                f"context parallelism {built}; it needs {want} (a Transformer Engine model "
                f"built with context_parallel_size={cp_size} for 'model', a model built with "
                f"model_pg_collection_without_cp() for 'loss')"
            )
