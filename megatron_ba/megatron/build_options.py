"""How the policy model is built on this rank: precision, layer spec, SP, recomputation, CP.

    opts = resolve_build_options(precision="bf16", transformer_impl="auto", attention="auto",
                                 recompute="selective", device=ctx.device, layout=ctx.layout)
    config = model.transformer_config(spec, **opts.config_fields())
    chunks = model.build_model_chunks(spec, config=config,
                                      layer_spec=opts.layer_spec(spec, config),
                                      pg_collection=opts.pg_collection(), ...)

The recipe keys are `model.precision`, `model.transformer_impl`, `model.attention`,
`parallel.sequence_parallel`, `parallel.recompute` and the uneven pipeline stages'
`parallel.pp_first_stage_layers` / `parallel.pp_last_stage_layers`; every rejected combination
is a ValueError naming the key. What runs where (megatron-core 0.16.1):

* Transformer Engine ("transformer_engine"; "auto" picks it when `transformer_engine` imports and
  the device is a GPU): fused kernels, and attention that runs context parallelism itself, so a
  TE model is built with `context_parallel_size = cp` and gets CP-sharded batches
  (grpo_step's cp_mode "model"). The local spec ("local") runs on CPU; its attention cannot run
  CP, so the model is built without CP (its CP process group is this rank alone,
  `model.model_pg_collection_without_cp`) and CP is applied at the loss (cp_mode "loss").
* Attention of the local spec (`model.attention`): "unfused" is megatron-core's
  DotProductAttention (scores and probabilities materialised: [b, heads, s, s] each), "sdpa" is
  megatron_ba.megatron.sdpa_attention (torch's scaled_dot_product_attention: flash or
  memory-efficient kernels on CUDA, memory linear in the length; equal to the unfused core in
  float64, forward and backward, on megatron-core 0.16.1 and 0.19.2:
  tests/test_sdpa_attention.py). "auto" picks sdpa on CUDA, where long sequences need it, and
  unfused on the CPU, where sequences are short and the suite's figures were recorded with it
  (they stay bit-for-bit unchanged). A Transformer Engine build has TE's own attention: naming
  sdpa or unfused there is an error.
* Sequence parallelism (the layout's; it needs TP > 1: megatron_ba.parallel.parallel_layout) needs
  Transformer Engine on CUDA: there the local spec's
  norms refuse it (megatron-core's WrappedTorchNorm asserts `not config.sequence_parallel`).
  On the CPU the local spec runs it (cpu_compat shim 6 marks its norms' weights for the TP
  all-reduce of their gradients, as Transformer Engine's are).
* Recomputation: "full" recomputes each layer in backward (recompute_granularity "full",
  method "uniform", one layer per checkpoint); "selective" recomputes the core attention
  (megatron-core's default recompute_modules ["core_attn"]). Both run with the local spec on
  CPU too (cpu_compat shim 3) and leave the gradients bit for bit unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from megatron_ba.megatron import hybrid
from megatron_ba.megatron.model import (
    local_layer_spec,
    model_pg_collection_without_cp,
    moe_layer_spec,
    stage_config_fields,
)
from megatron_ba.parallel.parallel_layout import ParallelLayout

TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")
ATTENTIONS = ("auto", "sdpa", "unfused")
RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("fp32", "bf16")


def te_available() -> bool:
    """Whether Transformer Engine imports in this environment."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken build (missing CUDA libraries)
        return False
    return True


@dataclass(frozen=True)
class BuildOptions:
    """Resolved options ("auto" already decided) of one rank's model build."""

    precision: str = "fp32"
    transformer_impl: str = "local"  # "local" | "transformer_engine"
    attention: str = "unfused"  # "unfused" | "sdpa" (local spec) | "transformer_engine"
    sequence_parallel: bool = False
    recompute: str = "none"
    cp: int = 1  # the parallel state's CP size
    # the layout's uneven pipeline stages as TransformerConfig fields (model.stage_config_fields)
    stage_fields: tuple[tuple[str, int], ...] = ()

    @property
    def model_cp(self) -> int:
        """The CP size the model itself runs: cp with TE attention, 1 with the local spec."""
        return self.cp if self.transformer_impl == "transformer_engine" else 1

    @property
    def cp_mode(self) -> str:
        """grpo_step's cp_mode that matches this build: "model" (TE) or "loss" (local)."""
        return "model" if self.transformer_impl == "transformer_engine" else "loss"

    def config_fields(self) -> dict[str, Any]:
        """TransformerConfig fields of these options (model.transformer_config's overrides)."""
        bf16 = self.precision == "bf16"
        dtype = torch.bfloat16 if bf16 else torch.float32
        out: dict[str, Any] = dict(
            bf16=bf16,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            sequence_parallel=self.sequence_parallel,
            context_parallel_size=self.model_cp,
            **dict(self.stage_fields),
        )
        if self.recompute == "full":
            out.update(
                recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
            )
        elif self.recompute == "selective":
            out.update(recompute_granularity="selective")  # recompute_modules: ["core_attn"]
        return out

    def layer_spec(self, spec, config=None):
        """The layer spec: Transformer Engine's or the local one (q/k norms as `spec` says).
        A mixture-of-experts spec gets model.moe_layer_spec(config), the decoder block spec
        following the config's pattern of expert and dense layers (`config` required)."""
        if hybrid.is_hybrid(spec):
            return self._hybrid_layer_spec(spec, config)
        if spec.num_experts:
            return self._moe_layer_spec(config)
        if self.transformer_impl == "transformer_engine":
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_layer_with_transformer_engine_spec,
            )

            return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_layernorm)

        local = local_layer_spec(spec.qk_layernorm)
        if self.attention == "sdpa":
            # megatron-core (sdpa_attention imports it at module level): imported on use
            from megatron_ba.megatron.sdpa_attention import sdpa_layer_spec

            return sdpa_layer_spec(local)
        return local

    def _hybrid_layer_spec(self, spec, config):
        """Qwen3.5's block spec (megatron_ba.megatron.hybrid: local modules), its
        full-attention layers' core SDPAttention when `attention` is "sdpa"."""
        if config is None:
            raise ValueError("config: Qwen3.5's block spec needs the TransformerConfig")
        if self.transformer_impl != "local":
            raise ValueError(
                "transformer_impl: Qwen3.5's Gated DeltaNet and zero-centred norms are built from "
                "megatron-core's local modules here; Transformer Engine layers for them are not "
                "wired up (use transformer_impl local)"
            )
        block = hybrid.hybrid_block_spec(config, spec)
        if self.attention != "sdpa":
            return block
        from megatron_ba.megatron.sdpa_attention import sdpa_layer_spec

        layers = [
            layer if spec.is_linear_attention_layer(i) else sdpa_layer_spec(layer)
            for i, layer in enumerate(block.layer_specs)
        ]
        return dataclasses.replace(block, layer_specs=layers)

    def _moe_layer_spec(self, config):
        if config is None:
            raise ValueError(
                "config: a mixture-of-experts layer spec follows the TransformerConfig's "
                "moe_layer_freq; pass layer_spec(spec, config)"
            )
        block = moe_layer_spec(config, transformer_engine=self.transformer_impl != "local")
        if self.attention != "sdpa":
            return block
        from megatron_ba.megatron.sdpa_attention import sdpa_layer_spec

        layers = [sdpa_layer_spec(layer) for layer in block.layer_specs]
        return dataclasses.replace(block, layer_specs=layers)

    def pg_collection(self):
        """Process groups of the model: the defaults, except that a local-spec model at CP > 1
        gets a CP group of this rank alone (it sees whole sequences). Collective."""
        if self.model_cp == self.cp:
            return None

        return model_pg_collection_without_cp()


def resolve_build_options(
    *,
    precision: str = "fp32",
    transformer_impl: str = "auto",
    attention: str = "auto",
    recompute: str = "none",
    device: torch.device | str,
    layout: ParallelLayout | None = None,
    te_imports: bool | None = None,
) -> BuildOptions:
    """Check the recipe's build keys against this rank's device and `layout` (its sequence
    parallelism and CP; None: a world of one); decide "auto".

    te_imports: whether Transformer Engine imports (default: try it); tests pass it.
    """
    device = torch.device(device)
    layout = ParallelLayout() if layout is None else layout
    cuda = device.type == "cuda"
    te = te_available() if te_imports is None else te_imports
    if precision not in PRECISIONS:
        raise ValueError(
            f"model.precision: must be one of {', '.join(PRECISIONS)}, got {precision!r}"
        )
    if precision == "bf16" and not cuda:
        raise ValueError(
            f"model.precision: bf16 needs CUDA (megatron-core's mixed-precision distributed "
            f"optimiser); this rank's device is {device}: use model.precision: fp32"
        )
    impl = _resolve_impl(transformer_impl, te, device)
    attention = _resolve_attention(attention, impl, cuda)
    if recompute not in RECOMPUTE:
        raise ValueError(
            f"parallel.recompute: must be one of {', '.join(RECOMPUTE)}, got {recompute!r}"
        )
    if layout.sequence_parallel and impl != "transformer_engine" and cuda:
        raise ValueError(
            "parallel.sequence_parallel: needs the Transformer Engine layer spec on CUDA "
            "(model.transformer_impl: transformer_engine); megatron-core's local spec's "
            "norms do not support it (only CPU runs shim them)"
        )
    return BuildOptions(
        precision=precision,
        transformer_impl=impl,
        attention=attention,
        sequence_parallel=layout.sequence_parallel,
        recompute=recompute,
        cp=layout.cp,
        stage_fields=tuple(stage_config_fields(layout).items()),
    )


def _resolve_impl(transformer_impl: str, te: bool, device: torch.device) -> str:
    """model.transformer_impl for this rank ("auto" decided; see the docstring)."""
    cuda = device.type == "cuda"
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(
            f"model.transformer_impl: must be one of {', '.join(TRANSFORMER_IMPLS)}, "
            f"got {transformer_impl!r}"
        )
    if transformer_impl == "auto":
        return "transformer_engine" if (te and cuda) else "local"
    if transformer_impl == "transformer_engine":
        if not te:
            raise ValueError(
                "model.transformer_impl: transformer_engine, but transformer_engine does not "
                "import here; install it or use auto / local"
            )
        if not cuda:
            raise ValueError(
                f"model.transformer_impl: transformer_engine needs CUDA; this rank's device is "
                f"{device}: use auto or local"
            )
    return transformer_impl


def _resolve_attention(attention: str, impl: str, cuda: bool) -> str:
    """model.attention for a build of layer spec `impl` ("auto" decided; see the docstring)."""
    if attention not in ATTENTIONS:
        raise ValueError(
            f"model.attention: must be one of {', '.join(ATTENTIONS)}, got {attention!r}"
        )
    if impl == "transformer_engine":
        if attention != "auto":
            raise ValueError(
                f"model.attention: {attention} chooses the local spec's core attention, but the "
                "layer spec is Transformer Engine's (its own fused attention); use "
                "model.attention: auto, or model.transformer_impl: local"
            )
        return "transformer_engine"
    if attention == "auto":
        return "sdpa" if cuda else "unfused"
    return attention


def expert_config_fields(spec, layout: ParallelLayout) -> dict[str, Any]:
    """TransformerConfig fields of `layout`'s expert parallelism for `spec` (none for a dense
    model): the config's EP decides how many experts each rank builds and which parameters
    megatron-core's DDP reduces over the expert-data-parallel group instead of the data-parallel
    one."""
    if not spec.num_experts:
        return {}
    return dict(expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.expert_tp)
