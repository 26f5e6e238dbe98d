"""How the policy model is built on this rank: precision, layer spec, SP, recomputation, CP.

    opts = resolve_build_options(precision="bf16", transformer_impl="auto", attention="auto",
                                 sequence_parallel=True, recompute="selective",
                                 device=ctx.device, tp=2, cp=2)
    config = model.transformer_config(spec, **opts.config_fields())
    chunks = model.build_model_chunks(spec, config=config,
                                      layer_spec=opts.layer_spec(spec, config),
                                      pg_collection=opts.pg_collection(), ...)

The recipe keys are `model.precision`, `model.transformer_impl`, `model.attention`,
`parallel.sequence_parallel` and `parallel.recompute`; every rejected combination is a ValueError
naming the key. What runs where (megatron-core 0.16.1):

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
* Sequence parallelism needs TP > 1, and Transformer Engine on CUDA: there the local spec's
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

from megatron_ba.megatron.model import (
    local_layer_spec,
    model_pg_collection_without_cp,
    moe_layer_spec,
)

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
    sequence_parallel: bool = False,
    recompute: str = "none",
    device: torch.device | str,
    tp: int = 1,
    cp: int = 1,
    te_imports: bool | None = None,
) -> BuildOptions:
    """Check the recipe's build keys against this rank's device and layout; decide "auto".

    te_imports: whether Transformer Engine imports (default: try it); tests pass it.
    """
    device = torch.device(device)
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
    if not isinstance(sequence_parallel, bool):
        raise ValueError(
            f"parallel.sequence_parallel: must be true or false, got {sequence_parallel!r}"
        )
    if sequence_parallel:
        if tp < 2:
            raise ValueError(
                f"parallel.sequence_parallel: needs parallel.tp > 1 (it splits the sequence over "
                f"the tensor-parallel ranks), got tp={tp}"
            )
        if impl != "transformer_engine" and cuda:
            raise ValueError(
                "parallel.sequence_parallel: needs the Transformer Engine layer spec on CUDA "
                "(model.transformer_impl: transformer_engine); megatron-core's local spec's "
                "norms do not support it (only CPU runs shim them)"
            )
    return BuildOptions(
        precision=precision,
        transformer_impl=impl,
        attention=attention,
        sequence_parallel=sequence_parallel,
        recompute=recompute,
        cp=int(cp),
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


# The names under which the expert-parallel settings reach a user: the layout check's flags, the
# recipe's keys. Each error names the one at fault.
CHECK_LAYOUT_KEYS = {
    "tp": "--tp",
    "ep": "--ep",
    "etp": "--etp",
    "model": "--model",
    "sequence_parallel": "--sequence-parallel",
}
RECIPE_KEYS = {
    "tp": "parallel.tp",
    "sequence_parallel": "parallel.sequence_parallel",
    "ep": "parallel.ep",
    "etp": "parallel.etp",
    "model": "model.num_experts",
}


def check_expert_parallel(
    spec, *, tp: int, ep: int, etp: int | None, keys: dict, sequence_parallel: bool = False
) -> None:
    """ValueError naming the key (`keys`: CHECK_LAYOUT_KEYS or RECIPE_KEYS) when `spec` cannot
    be built with expert parallelism `ep` and expert tensor parallelism `etp` (None: megatron-
    core's default, tp) at tensor parallelism `tp` (MoE at tp > 1 only with sequence
    parallelism: Transformer Engine on GPUs, the local spec on CPU). Whether the world's ranks
    can carve it:
    megatron_ba.parallel.world.check_expert_layout."""
    for name, v in (("ep", ep), ("etp", etp)):
        if not (v is None and name == "etp") and not (isinstance(v, int) and v >= 1):
            raise ValueError(f"{keys[name]}: must be an integer >= 1, got {v!r}")
    if not spec.num_experts:
        if ep != 1 or etp is not None:
            raise ValueError(
                f"{keys['ep']}/{keys['etp']}: need a mixture-of-experts model "
                f"({keys['model']}); this one is dense"
            )
        return
    if tp > 1 and not sequence_parallel:
        # Without sequence parallelism every TP rank holds the same tokens and the MoE layer
        # routes each of them once per TP rank: the experts' gradients come out TP times too
        # large (measured: exactly 2x at TP2 x EP2, ETP 2 or 1; the forward is right).
        # megatron-core refuses to train MoE at TP > 1 without sequence parallelism.
        raise ValueError(
            f"{keys['tp']}: {tp} with a mixture-of-experts model needs sequence parallelism "
            f"(megatron-core's MoE layer): turn on {keys['sequence_parallel']}, or run tp=1 "
            f"(expert TP, {keys['etp']}, is allowed)"
        )
    if spec.num_experts % ep:
        raise ValueError(f"{keys['ep']}: {ep} does not divide the {spec.num_experts} experts")
    if spec.moe_ffn_hidden_size % (etp or tp):
        raise ValueError(
            f"{keys['etp']}: {etp or tp} does not divide "
            f"moe_ffn_hidden_size={spec.moe_ffn_hidden_size}"
        )


def expert_config_fields(spec, *, tp: int, ep: int, etp: int | None) -> dict[str, Any]:
    """TransformerConfig fields of expert parallelism for `spec` (none for a dense model): the
    config's EP decides how many experts each rank builds and which parameters megatron-core's
    DDP reduces over the expert-data-parallel group instead of the data-parallel one."""
    if not spec.num_experts:
        return {}
    return dict(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp or tp)
