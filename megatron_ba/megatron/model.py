"""A Qwen2-shaped megatron-core GPTModel, and full-shape weights in and out of its shards.

    spec = ModelSpec(vocab_size=..., hidden_size=..., num_layers=..., num_attention_heads=...,
                     num_query_groups=..., ffn_hidden_size=...)   # or spec_from_hf_config(cfg)
    # after torch.distributed and parallel_state.initialize_model_parallel(tp, pp, ...)
    chunks = build_model_chunks(spec)                # [DDP(GPTModel)] for this rank's stage
    load_full_state_dict(chunks, full_init_state_dict(spec, seed=0))  # same weights, any layout
    full = gather_full_state_dict(chunks)            # {megatron TP=1/PP=1 name: full tensor}
    grads = gather_full_state_dict(chunks, grads=True)

The architecture is Qwen2's or Qwen3's: RMSNorm, SwiGLU MLP without biases, RoPE (theta
`rope_theta`, not interleaved), grouped-query attention with a bias on the fused QKV projection
(Qwen2) or RMSNorms on each q and k head (Qwen3, `qk_layernorm`), an explicit head dimension
(`kv_channels`), tied or untied output layer.
By default it is built from megatron-core's `get_gpt_layer_local_spec()` (no Transformer Engine),
so it runs on CPU with megatron_ba.megatron.cpu_compat installed; on GPUs pass a Transformer Engine
layer spec (`layer_spec=`) for fused kernels and context-parallel attention
(megatron_ba.megatron.build_options chooses the spec, precision, SP, recomputation and the
model's CP from the recipe; `check_cp_agreement` refuses a batch sharded unlike the model).

Full-shape state dicts use megatron-core's own names at TP=1 / PP=1 (`embedding.word_embeddings.
weight`, `decoder.layers.{i}.self_attention.linear_qkv.weight`, ..., `output_layer.weight`), with
global layer numbers and megatron's fused layouts (QKV rows grouped per query group: for each
group, its q heads then one k and one v head; `linear_fc1` = [gate; up]). Converting these names
and layouts to Hugging Face Qwen2 is the caller's business. Every rank may call the gather; every
rank gets the whole dict (CPU tensors).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_ba.conversion.names import megatron_layer_name, split_megatron_layer
from megatron_ba.parallel import collectives
from megatron_ba.parallel.layout import tp_shard

FAMILIES = ("qwen2", "qwen3")


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Qwen-family decoder (field names follow megatron-core where they overlap).

    family: "qwen2" (Qwen2 / Qwen2.5: QKV bias) or "qwen3" (q/k RMSNorm, no QKV bias); it names
    the Hugging Face conversion table (megatron_ba.conversion) and does not change the build:
    the flags below do. kv_channels: the head dimension when it is not hidden / heads (Qwen3);
    None means hidden_size // num_attention_heads. tie_word_embeddings: the output layer reuses
    the embedding (megatron-core's share_embeddings_and_output_weights).
    Build one from a Hugging Face config.json with megatron_ba.conversion.spec_from_hf_config.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    qkv_bias: bool = True
    init_std: float = 0.02
    params_dtype: torch.dtype = torch.float32
    config_overrides: dict[str, Any] = field(default_factory=dict)
    family: str = "qwen2"
    qk_layernorm: bool = False
    kv_channels: int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_query_groups",
            "ffn_hidden_size",
            "max_position_embeddings",
        ):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"family: must be one of {FAMILIES}, got {self.family!r}")
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size: {self.hidden_size} must be a multiple of num_attention_heads "
                    f"({self.num_attention_heads}), or set kv_channels (the head dimension)"
                )
        elif not (isinstance(self.kv_channels, int) and self.kv_channels >= 1):
            raise ValueError(
                f"kv_channels: must be an integer >= 1 or None, got {self.kv_channels!r}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_query_groups: {self.num_query_groups} must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )

    @property
    def head_dim(self) -> int:
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self) -> int:
        return sum(math.prod(s) for s in full_parameter_shapes(self).values())

    def check_layout(self, tp: int, pp: int) -> None:
        """ValueError naming what does not divide, for a TP x PP layout of this model."""
        problems = []
        for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size"):
            if getattr(self, name) % tp:
                problems.append(f"{name}={getattr(self, name)} is not a multiple of tp={tp}")
        if self.num_layers % pp:
            problems.append(f"num_layers={self.num_layers} is not a multiple of pp={pp}")
        if problems:
            raise ValueError("layout: " + "; ".join(problems))


# The name callers used before the spec covered Qwen3 (same fields, family "qwen2" by default).
Qwen2Spec = ModelSpec


def tiny_qwen2_spec(**changes: Any) -> ModelSpec:
    """A Qwen2-shaped model small enough for multi-process CPU tests (~60k parameters).

    head_dim 16, 4 query heads in 2 groups: TP=2 splits both; 4 layers: PP=2 (or 4) splits them.
    """
    base = dict(
        vocab_size=128,
        hidden_size=64,
        num_layers=4,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        max_position_embeddings=256,
        rope_theta=10_000.0,
    )
    base.update(changes)
    return ModelSpec(**base)


def transformer_config(spec: ModelSpec, *, cpu: bool | None = None, **overrides: Any):
    """megatron-core TransformerConfig of `spec` for the parallel layout now initialised."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    if cpu is None:
        cpu = not torch.cuda.is_available()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    spec.check_layout(tp, pp)
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
        from megatron_ba.megatron import cpu_compat

        cpu_compat.install()
        kwargs.update(cpu_compat.CPU_CONFIG_OVERRIDES)
    kwargs.update(spec.config_overrides)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


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
    (with q/k layernorms when the spec has them). A Transformer Engine spec must be built with
    the same `qk_layernorm`.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = config if config is not None else transformer_config(spec)
    kwargs: dict[str, Any] = {}
    if pg_collection is not None:  # megatron-core >= 0.14 only
        kwargs["pg_collection"] = pg_collection
    if vp_stage is not None:
        kwargs["vp_stage"] = vp_stage
    return GPTModel(
        config=config,
        transformer_layer_spec=(
            layer_spec if layer_spec is not None else local_layer_spec(spec.qk_layernorm)
        ),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,  # logits stay vocab-sharded: log-probs are vocab-parallel
        # Tied: at PP > 1 the last stage holds a copy of the embedding that megatron-core
        # all-reduces at build time with `.cuda()` (0.16.1): tied models need PP=1 on CPU.
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta),
        **kwargs,
    )


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
        # before DDP; the optimiser keeps the fp32 main weights (mcore_optimizer).
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
    model = _unwrap(chunk)
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
        model = _unwrap(chunk)
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


# ---------------------------------------------------------------------------------------------
# Full-shape weights: deterministic initialisation, loading into shards, gathering back.


def full_parameter_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the unsharded (TP=1, PP=1) model (local-spec names;
    a tied model has no `output_layer.weight`)."""
    h, f, v, d = spec.hidden_size, spec.ffn_hidden_size, spec.vocab_size, spec.head_dim
    qkv = (spec.num_attention_heads + 2 * spec.num_query_groups) * d
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (v, h)}
    for i in range(spec.num_layers):
        p = f"decoder.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attention.linear_qkv.weight"] = (qkv, h)
        if spec.qkv_bias:
            shapes[p + "self_attention.linear_qkv.bias"] = (qkv,)
        shapes[p + "self_attention.linear_proj.weight"] = (h, spec.num_attention_heads * d)
        if spec.qk_layernorm:  # one RMSNorm weight over each head's channels, shared by heads
            shapes[p + "self_attention.q_layernorm.weight"] = (d,)
            shapes[p + "self_attention.k_layernorm.weight"] = (d,)
        shapes[p + "pre_mlp_layernorm.weight"] = (h,)
        shapes[p + "mlp.linear_fc1.weight"] = (2 * f, h)
        shapes[p + "mlp.linear_fc2.weight"] = (h, f)
    shapes["decoder.final_layernorm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["output_layer.weight"] = (v, h)
    return shapes


def full_init_state_dict(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic full-shape weights: N(0, init_std) matrices, norms near 1, small biases.

    Norm weights and biases are perturbed (not 1 / 0) so that a gradient check sees every
    parameter's gradient path, including the ones a constant initialisation would hide.
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in full_parameter_shapes(spec).items():
        if name.endswith("layernorm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
        else:
            t = spec.init_std * torch.randn(shape, generator=g, dtype=torch.float64)
        out[name] = t.to(spec.params_dtype)
    return out


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def local_to_full_names(chunks: list[torch.nn.Module]) -> dict[str, tuple[torch.nn.Parameter, str]]:
    """Full (global) name -> (local parameter, local name) for this rank's chunks."""
    out: dict[str, tuple[torch.nn.Parameter, str]] = {}
    for chunk in chunks:
        model = _unwrap(chunk)
        layers = model.decoder.layers if hasattr(model, "decoder") else []
        for local_name, param in model.named_parameters():
            name = local_name
            parts = split_megatron_layer(local_name)
            if parts:  # local index -> global layer number (1-based in megatron-core)
                name = megatron_layer_name(layers[parts[0]].layer_number - 1, parts[1])
            out[name] = (param, local_name)
    return out


def tp_layout(param: torch.nn.Parameter) -> tuple[bool, int, int]:
    """(sharded over TP, partition dim, partition stride) of a megatron-core parameter."""
    sharded = bool(getattr(param, "tensor_model_parallel", False))
    return (
        sharded,
        int(getattr(param, "partition_dim", 0)),
        int(getattr(param, "partition_stride", 1)),
    )


EMBEDDING = "embedding.word_embeddings.weight"


@torch.no_grad()
def load_full_tensors(
    chunks: list[torch.nn.Module], read: Callable[[str], torch.Tensor]
) -> list[str]:
    """Copy full-shape tensors, fetched one at a time by `read(full_name)`, into this rank's
    shards; return the names loaded. Streaming: only one full tensor is alive at a time.

    A tied model's last stage at PP > 1 holds a copy of the embedding (`output_layer.weight`,
    marked `shared_embedding` by megatron-core): it is read as the embedding.
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    loaded = []
    for name, (param, _) in local_to_full_names(chunks).items():
        source = EMBEDDING if getattr(param, "shared_embedding", False) else name
        src = read(source)
        sharded, dim, stride = tp_layout(param)
        piece = tp_shard(src, dim=dim, stride=stride, rank=rank, size=tp) if sharded else src
        if piece.shape != param.shape:
            raise ValueError(
                f"full: {name!r} has shape {tuple(src.shape)}, which does not shard to this "
                f"rank's {tuple(param.shape)} (tp={tp}, dim={dim}, stride={stride})"
            )
        param.copy_(piece.to(param.dtype))
        loaded.append(name)
    return loaded


def load_full_state_dict(chunks: list[torch.nn.Module], full: dict[str, torch.Tensor]) -> None:
    """Copy a full-shape (TP=1, PP=1 names) state dict into this rank's shards.

    Every parameter this rank holds must be in `full` with the full shape (ValueError
    otherwise); entries for other pipeline stages are ignored.
    """

    def read(name: str) -> torch.Tensor:
        if name not in full:
            raise ValueError(f"full: missing parameter {name!r}")
        return full[name]

    load_full_tensors(chunks, read)


def _local_tensor(param: torch.nn.Parameter, grads: bool) -> torch.Tensor:
    if not grads:
        return param.detach()
    t = getattr(param, "main_grad", None)
    if t is None:
        t = param.grad
    return (torch.zeros_like(param) if t is None else t).detach()


def gather_full_state_dict(
    chunks: list[torch.nn.Module], *, grads: bool = False
) -> dict[str, torch.Tensor]:
    """The full-shape (TP=1, PP=1 names) parameters, or their gradients, on every rank.

    A collective over the tensor- and pipeline-parallel groups: every rank of them must call it.
    Gradients are read from `main_grad` (megatron-core DDP) or `.grad`; call it after the
    schedule's `finalize_model_grads` to see the data-parallel-reduced gradient. Tensors come
    back as CPU copies in the parameters' dtype. Holds the whole model once more; to stream
    (an export), use `iter_full_tensors`.
    """
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    local: dict[str, torch.Tensor] = {}
    for name, (param, _) in local_to_full_names(chunks).items():
        t = _local_tensor(param, grads)
        sharded, dim, stride = tp_layout(param)
        if sharded:
            t = collectives.gather_tensor_parallel(t, dim=dim, stride=stride, group=tp_group)
        local[name] = t.to(param.dtype).clone()  # a copy: buffers change at the next step
    merged = collectives.gather_pipeline_stages(local, group=pp_group)
    return {k: v.cpu() for k, v in sorted(merged.items(), key=lambda kv: _order(kv[0]))}


def iter_full_tensors(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """(full name, full-shape CPU tensor) of every parameter, one at a time, on every rank.

    The streaming form of `gather_full_state_dict` (a collective over the TP and PP groups:
    every rank must exhaust the iterator): one full tensor is alive at a time, so an export
    needs the model's shards plus its largest tensor, not a second copy of the model.
    """
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    held = local_to_full_names(chunks)
    # The names of every stage (empty placeholders travel, not the tensors).
    names = collectives.gather_pipeline_stages({k: torch.empty(0) for k in held}, group=pp_group)
    for name in sorted(names, key=_order):
        one: dict[str, torch.Tensor] = {}
        if name in held:
            param = held[name][0]
            t = param.detach()
            sharded, dim, stride = tp_layout(param)
            if sharded:
                t = collectives.gather_tensor_parallel(t, dim=dim, stride=stride, group=tp_group)
            one[name] = t.clone()
        yield name, collectives.gather_pipeline_stages(one, group=pp_group)[name].cpu()


def _order(name: str) -> tuple[int, int, str]:
    parts = split_megatron_layer(name)
    if name.startswith("embedding."):
        return (0, 0, name)
    if parts:
        return (1, parts[0], name)
    return (2, 0, name)
