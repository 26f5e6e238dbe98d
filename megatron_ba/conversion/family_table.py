"""The family-independent part of HF <-> megatron-core conversion: fused layouts and name rules.

A family module (qwen2.py, qwen3.py) holds a `FamilyTable`: for each megatron-core parameter (in
the full-shape, TP=1 / PP=1 naming of megatron_ba.parallel.full_shape, local layer spec spelling) a
rule saying which Hugging Face tensors it is made of:

- `Copy(hf)`: the same tensor under another name;
- `FusedQKV(q, k, v)`: megatron's `linear_qkv` holds, for each query group g, its r = heads /
  groups q heads, then one k head, then one v head (rows [g][q_1..q_r, k, v][head_dim]); HF holds
  q_proj / k_proj / v_proj with q head j in kv group j // r, so the split is a reshape per group;
- `GatedFC1(gate, up)`: megatron's `linear_fc1` is [gate; up] stacked along rows.

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
from dataclasses import dataclass, field

import torch

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


Rule = Copy | FusedQKV | GatedFC1

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
    """

    family: str
    model_type: str
    architecture: str
    top: Mapping[str, Rule]
    layer: Mapping[str, Rule]
    optional: Mapping[str, str]
    moe_layer: Mapping[str, Rule] = field(default_factory=dict)
    expert: Mapping[str, Rule] = field(default_factory=dict)

    def rule(self, name: str) -> tuple[Rule, int | None]:
        """(rule, layer index or None) of a megatron name (either spelling); KeyError if none."""
        name = canonical_name(name)
        if name in self.top:
            return self.top[name], None
        parts = split_megatron_layer(name)
        if parts is not None and parts[1] in self.layer:
            return self.layer[parts[1]], parts[0]
        if parts is not None and parts[1] in self.moe_layer:
            return self.moe_layer[parts[1]], parts[0]
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
        out = []
        for rest in self.layer:
            flag = self.optional.get(rest)
            if (flag is None or getattr(spec, flag)) and not (moe and rest.startswith("mlp.")):
                out.append(rest)
        if moe:
            out += list(self.moe_layer)
            out += [expert_name(j, r) for j in range(spec.num_experts) for r in self.expert]
        return out

    def hf_names_of(self, name: str) -> list[str]:
        rule, i = self.rule(name)
        hf = [rule.hf] if isinstance(rule, Copy) else list(vars(rule).values())
        return hf if i is None else [hf_layer_name(i, h) for h in hf]

    def hf_names(self, spec) -> list[str]:
        """Every HF tensor a checkpoint of `spec` holds (a tied model has no lm_head)."""
        return [h for n in self.megatron_names(spec) for h in self.hf_names_of(n)]


# --- fused layouts --------------------------------------------------------------------------


def split_qkv(t: torch.Tensor, heads: int, groups: int, head_dim: int):
    """megatron [groups * (r + 2) * head_dim, ...] -> q [heads * head_dim, ...], k, v."""
    r = heads // groups
    rest = t.shape[1:]
    if t.shape[0] != groups * (r + 2) * head_dim:
        raise ValueError(
            f"linear_qkv: {t.shape[0]} rows, expected groups*(heads/groups+2)*head_dim = "
            f"{groups}*({r}+2)*{head_dim}"
        )
    g = t.reshape(groups, r + 2, head_dim, *rest)
    q = g[:, :r].reshape(heads * head_dim, *rest)
    k = g[:, r].reshape(groups * head_dim, *rest)
    v = g[:, r + 1].reshape(groups * head_dim, *rest)
    return q, k, v


def merge_qkv(q, k, v, heads: int, groups: int, head_dim: int) -> torch.Tensor:
    """The inverse of `split_qkv`."""
    r = heads // groups
    rest = q.shape[1:]
    for what, t, rows in (("q", q, heads), ("k", k, groups), ("v", v, groups)):
        if t.shape[0] != rows * head_dim:
            raise ValueError(f"{what}_proj: {t.shape[0]} rows, expected {rows} * {head_dim}")
    fused = torch.cat(
        [
            q.reshape(groups, r, head_dim, *rest),
            k.reshape(groups, 1, head_dim, *rest),
            v.reshape(groups, 1, head_dim, *rest),
        ],
        dim=1,
    )
    return fused.reshape(-1, *rest)


def split_gated(t: torch.Tensor):
    """megatron linear_fc1 [gate; up] -> (gate, up)."""
    gate, up = t.chunk(2, dim=0)
    return gate, up


def merge_gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=0)


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
    if isinstance(rule, Copy):
        return full[0]
    if isinstance(rule, FusedQKV):
        return merge_qkv(*full, spec.num_attention_heads, spec.num_query_groups, spec.head_dim)
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
    if isinstance(rule, Copy):
        parts = (tensor,)
    elif isinstance(rule, FusedQKV):
        parts = split_qkv(tensor, spec.num_attention_heads, spec.num_query_groups, spec.head_dim)
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
