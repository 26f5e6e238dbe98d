"""The family-independent part of HF <-> megatron-core conversion: fused layouts and name rules.

A family module (qwen2.py, qwen3.py) holds a `FamilyTable`: for each megatron-core parameter (in
the full-shape, TP=1 / PP=1 naming of megatron_ba.parallel.full_shape, local layer spec spelling) a
rule saying which Hugging Face tensors it is made of:

- `Copy(hf)`: the same tensor under another name;
- `FusedQKV(q, k, v)`: megatron's `linear_qkv` holds, for each query group g, its r = heads /
  groups q heads, then one k head, then one v head (rows [g][q_1..q_r, k, v][head_dim]); HF holds
  q_proj / k_proj / v_proj with q head j in kv group j // r, so the split is a reshape per group;
- `GatedFC1(gate, up)`: megatron's `linear_fc1` is [gate; up] stacked along rows;
- `GatedQKV(q, k, v)` (Qwen3.5's full attention with an output gate): HF `q_proj` has 2 * heads
  * head_dim rows, per head h [q_h; gate_h] (transformers' Qwen3NextAttention views its output as
  (..., heads, 2 * head_dim) and chunks the last dim into query and gate); megatron's
  `linear_qkv` holds, for each query group g, [its r q heads; its r gate heads; its k head; its
  v head] (rows [g][q_1..q_r, gate_1..gate_r, k, v][head_dim], megatron-core's
  get_query_key_value_tensors with output_gate), q / gate head j of group g being HF head
  g * r + j;
- `DeltaNetInProj(qkv, z, b, a)` (a Gated DeltaNet layer): megatron's `in_proj` is the rows of
  HF's `in_proj_qkv` (2 Kd + Vd: q; k; v), `in_proj_z` (Vd), `in_proj_b` (nv: beta) and
  `in_proj_a` (nv: alpha) stacked in that order (megatron-core's GatedDeltaNet splits its output
  so), Kd = linear_num_key_heads * linear_key_head_dim, Vd = linear_num_value_heads *
  linear_value_head_dim, nv = linear_num_value_heads.

One table serves both directions, so a name can never map one way and not back. Transformer
Engine layer specs spell two parameters differently (the norm before a linear is fused into it:
`self_attention.linear_qkv.layer_norm_weight` is the local spec's `input_layernorm.weight`,
`mlp.linear_fc1.layer_norm_weight` is `pre_mlp_layernorm.weight`) and add `_extra_state` buffers
(FP8 metadata, not weights): `canonical_name` folds those spellings onto the local ones, so the
tables list each parameter once. q/k layernorms are spelled the same in both specs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch

from megatron_ba.conversion.fused_layouts import (
    merge_gated,
    merge_gated_qkv,
    merge_in_proj,
    merge_qkv,
    split_gated,
    split_gated_qkv,
    split_in_proj,
    split_qkv,
)
from megatron_ba.parallel.full_shape import EMBEDDING, megatron_layer_name, split_megatron_layer


@dataclass(frozen=True)
class Copy:
    hf: str


@dataclass(frozen=True)
class FusedQKV:
    q: str
    k: str
    v: str


@dataclass(frozen=True)
class GatedFC1:
    gate: str
    up: str


@dataclass(frozen=True)
class GatedQKV:
    q: str
    k: str
    v: str


@dataclass(frozen=True)
class DeltaNetInProj:
    qkv: str
    z: str
    b: str
    a: str


Rule = Copy | FusedQKV | GatedFC1 | GatedQKV | DeltaNetInProj

# Transformer Engine spelling -> local spec spelling (per layer); see the module docstring.
# megatron-core's own map says the same: its local layer spec (0.16.1, gpt_layer_specs.py,
# get_gpt_layer_local_spec) saves `input_layernorm.` as `self_attention.linear_qkv.layer_norm_`
# and `pre_mlp_layernorm.` as `mlp.linear_fc1.layer_norm_` (sharded_state_dict_keys_map), so
# that local and TE checkpoints share keys; tests/test_devices_step.py
# (test_local_spec_checkpoint_keys_are_the_converters_te_spelling) checks the two agree.
TE_SPELLINGS: dict[str, str] = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
LOCAL_TO_TE: dict[str, str] = {local: te for te, local in TE_SPELLINGS.items()}
SPELLINGS = ("local", "transformer_engine")

OUTPUT_LAYER = "output_layer.weight"
# A SequentialMLP expert's parameter in a MoE layer: `mlp.experts.local_experts.{j}.{rest}`, with
# j the global expert number in a full-shape name (conversion/experts.py renumbers a rank's
# local experts under expert parallelism).
EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


# Transformer Engine's grouped-GEMM experts (TEGroupedMLP, GPUs) hold expert e's matrix as
# `mlp.experts.linear_fc1.weight{e}`: the same tensor as SequentialMLP's, another name. Read
# only (folded by canonical_name; not run here: no Transformer Engine on CPU).
TE_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12]\.weight)(\d+)$")


def expert_name(j: int, rest: str) -> str:
    return f"mlp.experts.local_experts.{j}.{rest}"


def _for_expert(rule: Rule, j: int) -> Rule:
    """An expert rule (HF names with `{e}`) for expert j."""
    return type(rule)(**{k: v.format(e=j) for k, v in vars(rule).items()})


def hf_layer_name(index: int, rest: str) -> str:
    """Hugging Face Qwen's name of a layer's tensor: `model.layers.{index}.{rest}`."""
    return f"model.layers.{index}.{rest}"


def is_skipped(name: str) -> bool:
    """Buffers that are not weights: TE's `_extra_state` (FP8 scales) and rotary caches."""
    return name.endswith("_extra_state") or "rotary_pos_emb" in name or "rotary_emb" in name


def canonical_name(name: str) -> str:
    """A megatron parameter name in the local-spec spelling (TE spellings folded onto it)."""
    parts = split_megatron_layer(name)
    if parts is None:
        return name
    i, rest = parts
    grouped = TE_GROUPED_EXPERT.match(rest)
    if grouped is not None:  # expert e's weight of a grouped GEMM -> its SequentialMLP name
        return megatron_layer_name(i, expert_name(int(grouped.group(2)), grouped.group(1)))
    return megatron_layer_name(i, TE_SPELLINGS.get(rest, rest))


def te_name(name: str) -> str:
    """A megatron parameter name in the Transformer Engine spelling (the inverse of
    `canonical_name` on layer norms; every other name is spelled the same)."""
    parts = split_megatron_layer(name)
    if parts is None:
        return name
    i, rest = parts
    return megatron_layer_name(i, LOCAL_TO_TE.get(rest, rest))


def spelled(name: str, spelling: str) -> str:
    """`name` in the "local" or "transformer_engine" spelling."""
    if spelling not in SPELLINGS:
        raise ValueError(f"spelling: must be one of {', '.join(SPELLINGS)}, got {spelling!r}")
    return te_name(name) if spelling == "transformer_engine" else canonical_name(name)


@dataclass(frozen=True)
class FamilyTable:
    """The name rules of one model family.

    top: full megatron name -> rule, outside the layers (embedding, final norm, output layer).
    layer: megatron per-layer suffix -> rule with HF per-layer suffixes.
    optional: per-layer suffix -> the spec attribute that must be true for it to exist
    (e.g. the QKV bias exists only when `spec.qkv_bias`).
    moe_layer: in a mixture-of-experts layer (`spec.is_moe_layer(i)`), the rules that replace
    `layer`'s dense `mlp.` ones (the router); expert: per-expert suffix (after
    `mlp.experts.local_experts.{j}.`) -> rule whose HF names hold `{e}`, the expert number.
    linear_layer: in a Gated DeltaNet layer (`spec.is_linear_attention_layer(i)`), the rules
    that replace `layer`'s `self_attention.` ones.
    hf_prefix: the HF prefix of the language model's tensors (`model.`; `model.language_model.`
    in Qwen3.5's ConditionalGeneration layout: `with_prefix`); the tables spell HF names with
    `model.` and `hf_names_of` puts this prefix in its place (`lm_head.` has none).
    carried: None (every tensor of a checkpoint is the table's), or the HF prefixes of tensors
    that are not the language model's and pass through a conversion unchanged (Qwen3.5's
    `model.visual.`, `mtp.`); with it, every tensor outside `hf_prefix` and `lm_head.` is
    carried too. refused: megatron name prefix -> what it is, for parts of the checkpoint that
    are carried and never converted (a model that holds them is refused by name).
    """

    family: str
    model_type: str
    architecture: str
    top: Mapping[str, Rule]
    layer: Mapping[str, Rule]
    optional: Mapping[str, str]
    moe_layer: Mapping[str, Rule] = field(default_factory=dict)
    expert: Mapping[str, Rule] = field(default_factory=dict)
    linear_layer: Mapping[str, Rule] = field(default_factory=dict)
    hf_prefix: str = "model."
    carried: tuple[str, ...] | None = None
    refused: Mapping[str, str] = field(default_factory=dict)

    def with_prefix(self, hf_prefix: str) -> FamilyTable:
        """This table with the language model's HF tensors under `hf_prefix`."""
        return self if hf_prefix == self.hf_prefix else replace(self, hf_prefix=hf_prefix)

    def hf_name(self, name: str) -> str:
        """A table's HF name (`model.`-spelled) under this table's prefix."""
        if name.startswith("model.") and self.hf_prefix != "model.":
            return self.hf_prefix + name[len("model.") :]
        return name

    def is_carried(self, hf_name: str) -> bool:
        """Whether a checkpoint's tensor is not the language model's (passed through unchanged)."""
        if self.carried is None:
            return False
        if hf_name.startswith(self.carried):
            return True
        return not hf_name.startswith((self.hf_prefix, "lm_head."))

    def _refuse(self, name: str) -> None:
        for prefix, what in self.refused.items():
            if name.startswith(prefix):
                raise ValueError(
                    f"{name}: {what} is not converted ({prefix}* parameters): the export carries "
                    f"the source checkpoint's tensors unchanged; build the model without it"
                )

    def rule(self, name: str) -> tuple[Rule, int | None]:
        """(rule, layer index or None) of a megatron name (either spelling); KeyError if none,
        ValueError for a part the table refuses (`refused`)."""
        name = canonical_name(name)
        self._refuse(name)
        if name in self.top:
            return self.top[name], None
        parts = split_megatron_layer(name)
        for rules in (self.layer, self.moe_layer, self.linear_layer):
            if parts is not None and parts[1] in rules:
                return rules[parts[1]], parts[0]
        m = EXPERT.match(parts[1]) if parts is not None else None
        if m is not None and m.group(2) in self.expert:
            return _for_expert(self.expert[m.group(2)], int(m.group(1))), parts[0]
        raise KeyError(
            f"no {self.family} Hugging Face name for megatron parameter {name!r} "
            f"(the model has a parameter the {self.family} table does not know)"
        )

    def megatron_names(self, spec) -> list[str]:
        """Every megatron parameter of `spec` (local spelling, global layer numbers), in order."""
        names = [EMBEDDING]
        for i in range(spec.num_layers):
            names += [megatron_layer_name(i, rest) for rest in self._layer_suffixes(spec, i)]
        names += [n for n in self.top if n != EMBEDDING]
        if spec.tie_word_embeddings:
            names.remove(OUTPUT_LAYER)
        return names

    def _layer_suffixes(self, spec, i: int) -> list[str]:
        moe = bool(getattr(spec, "num_experts", 0)) and spec.is_moe_layer(i)
        linear = bool(self.linear_layer) and spec.is_linear_attention_layer(i)
        out = []
        for rest in self.layer:
            flag = self.optional.get(rest)
            replaced = (moe and rest.startswith("mlp.")) or (
                linear and rest.startswith("self_attention.")
            )
            if (flag is None or getattr(spec, flag)) and not replaced:
                out.append(rest)
        if linear:
            out += list(self.linear_layer)
        if moe:
            out += list(self.moe_layer)
            out += [expert_name(j, r) for j in range(spec.num_experts) for r in self.expert]
        return out

    def hf_names_of(self, name: str) -> list[str]:
        rule, i = self.rule(name)
        hf = [rule.hf] if isinstance(rule, Copy) else list(vars(rule).values())
        hf = hf if i is None else [hf_layer_name(i, h) for h in hf]
        return [self.hf_name(h) for h in hf]

    def hf_names(self, spec) -> list[str]:
        """Every HF tensor a checkpoint of `spec` holds (a tied model has no lm_head)."""
        return [h for n in self.megatron_names(spec) for h in self.hf_names_of(n)]


# --- one tensor each way --------------------------------------------------------------------


def megatron_tensor(
    table: FamilyTable, spec, name: str, read: Callable[[str], torch.Tensor]
) -> torch.Tensor:
    """The full-shape megatron tensor `name`, built from HF tensors fetched by `read(hf_name)`.

    A tied model's last pipeline stage holds its own copy of the embedding as `output_layer`:
    it is read from the embedding.
    """
    if spec.tie_word_embeddings and canonical_name(name) == OUTPUT_LAYER:
        name = EMBEDDING
    rule, _ = table.rule(name)
    full = [read(h) for h in table.hf_names_of(name)]
    heads = (spec.num_attention_heads, spec.num_query_groups, spec.head_dim)
    if isinstance(rule, Copy):
        return full[0]
    if isinstance(rule, FusedQKV):
        return merge_qkv(*full, *heads)
    if isinstance(rule, GatedQKV):
        return merge_gated_qkv(*full, *heads)
    if isinstance(rule, DeltaNetInProj):
        return merge_in_proj(*full, spec)
    return merge_gated(*full)


def hf_tensors(
    table: FamilyTable, spec, name: str, tensor: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """The HF (name, tensor) pairs of one full-shape megatron tensor ([] for non-weights and a
    tied model's output-layer copy)."""
    if is_skipped(name) or (spec.tie_word_embeddings and canonical_name(name) == OUTPUT_LAYER):
        return []
    rule, _ = table.rule(name)
    names = table.hf_names_of(name)
    heads = (spec.num_attention_heads, spec.num_query_groups, spec.head_dim)
    if isinstance(rule, Copy):
        parts = (tensor,)
    elif isinstance(rule, FusedQKV):
        parts = split_qkv(tensor, *heads)
    elif isinstance(rule, GatedQKV):
        parts = split_gated_qkv(tensor, *heads)
    elif isinstance(rule, DeltaNetInProj):
        parts = split_in_proj(tensor, spec)
    else:
        parts = split_gated(tensor)
    return list(zip(names, parts, strict=True))


def iter_hf_tensors(
    table: FamilyTable, spec, full: Mapping[str, torch.Tensor] | Iterator
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for a full-shape megatron state dict or stream of (name, tensor)."""
    items = full.items() if isinstance(full, Mapping) else full
    for name, t in items:
        yield from hf_tensors(table, spec, name, t)
