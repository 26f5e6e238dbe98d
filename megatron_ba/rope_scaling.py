"""RoPE scaling of a Qwen model (YaRN): the settings, read from and written to config.json.

    scaling = rope_scaling_from_hf(cfg)        # None for plain RoPE, else a RopeScaling
    scaling.max_context                        # factor x original_max_position_embeddings
    scaling.hf_fields()                        # {"rope_type": "yarn", "factor": ..., ...}

Qwen3 reaches 64K / 128K tokens with YaRN (Qwen's documented setting: {"rope_type": "yarn",
"factor": 2.0 or 4.0, "original_max_position_embeddings": 32768}). Hugging Face keeps it in one of
two places: transformers 5 writes `rope_parameters` ({"rope_type", "rope_theta", "factor",
"original_max_position_embeddings", ...}), 4.x and most hub configs `rope_scaling` (the same keys
without rope_theta; `type` in older files) beside a top-level `rope_theta`. Both are read; when
both are set they must agree.

Only YaRN with its default attention factor is built (megatron-core's YaRN embedding; how it
matches transformers': megatron_ba.megatron.rope). Other rope types (linear, dynamic, llama3,
longrope) and the YaRN keys that change the attention factor (attention_factor, mscale,
mscale_all_dim) are refused with the key and value named. Pure Python: the planner reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SUPPORTED_TYPES = ("yarn",)
# YaRN keys a config.json may hold that the model here reads (rope_theta: hf_config's).
_READ = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings"}
_READ |= {"beta_fast", "beta_slow", "truncate"}
# YaRN keys that change the attention factor away from 0.1 ln(factor) + 1: not built here.
_REFUSED = ("attention_factor", "mscale", "mscale_all_dim", "partial_rotary_factor")


@dataclass(frozen=True)
class RopeScaling:
    """YaRN: inverse frequencies interpolated by `factor` where a dimension turns fewer than
    beta_slow times over `original_max_position_embeddings` tokens, kept where it turns more
    than beta_fast times, a linear ramp between (rounded to whole dimensions when `truncate`);
    cos and sin scaled by 0.1 ln(factor) + 1. Names are Hugging Face's."""

    factor: float
    original_max_position_embeddings: int
    type: str = "yarn"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.type not in SUPPORTED_TYPES:
            raise ValueError(
                f"rope_scaling.type: {self.type!r} is not supported (one of {SUPPORTED_TYPES})"
            )
        if not (isinstance(self.factor, (int, float)) and math.isfinite(self.factor)):
            raise ValueError(f"rope_scaling.factor: must be a number >= 1, got {self.factor!r}")
        if self.factor < 1:
            raise ValueError(f"rope_scaling.factor: must be >= 1, got {self.factor!r}")
        omp = self.original_max_position_embeddings
        if not (isinstance(omp, int) and omp >= 1):
            raise ValueError(
                f"rope_scaling.original_max_position_embeddings: must be an integer >= 1, "
                f"got {omp!r}"
            )

    @property
    def max_context(self) -> int:
        """The context YaRN stretches the model to: factor x original_max_position_embeddings."""
        return int(self.factor * self.original_max_position_embeddings)

    def hf_fields(self) -> dict:
        """The keys of config.json's `rope_scaling` / `rope_parameters` (without rope_theta);
        beta_fast, beta_slow and truncate only where they are not transformers' defaults."""
        out: dict = {
            "rope_type": self.type,
            "factor": self.factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }
        for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0), ("truncate", True)):
            if getattr(self, key) != default:
                out[key] = getattr(self, key)
        return out


def coerce(value) -> RopeScaling | None:
    """A RopeScaling from itself, a dict of its fields (a spec read back from JSON) or None."""
    if value is None or isinstance(value, RopeScaling):
        return value
    if isinstance(value, dict):
        return RopeScaling(**value)
    raise ValueError(f"rope_scaling: a RopeScaling, a dict of its fields or None, got {value!r}")


def _rope_type(d: dict) -> str:
    return d.get("rope_type", d.get("type", "default"))


def _from_dict(d: dict, key: str, cfg: dict, where: str) -> RopeScaling:
    rope_type = _rope_type(d)
    if rope_type not in SUPPORTED_TYPES:
        raise ValueError(
            f"{where}: {key}.rope_type {rope_type!r} is not supported by the megatron model "
            f"here (plain RoPE or {', '.join(SUPPORTED_TYPES)})"
        )
    for name in _REFUSED:
        if d.get(name) is not None:
            raise ValueError(
                f"{where}: {key}.{name} {d[name]!r} is not supported (YaRN with its default "
                "attention factor 0.1 ln(factor) + 1 only)"
            )
    unknown = sorted(set(d) - _READ - set(_REFUSED))
    if unknown:
        raise ValueError(f"{where}: {key} has keys the model here does not read: {unknown}")
    if d.get("factor") is None:
        raise ValueError(f"{where}: {key}.factor is missing (YaRN needs its scaling factor)")
    # transformers: a top-level original_max_position_embeddings wins; else max_position_embeddings
    omp = cfg.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
    omp = omp or cfg.get("max_position_embeddings")
    return RopeScaling(
        type=rope_type,
        factor=float(d["factor"]),
        original_max_position_embeddings=int(omp) if omp is not None else 0,
        beta_fast=float(d.get("beta_fast") or 32.0),  # transformers: `or 32`
        beta_slow=float(d.get("beta_slow") or 1.0),
        truncate=bool(d.get("truncate", True)),
    )


def rope_scaling_from_hf(cfg: dict, where: str = "config.json") -> RopeScaling | None:
    """The RoPE scaling of a Hugging Face config.json (a dict): None for plain RoPE.

    transformers 5 reads `rope_scaling` over `rope_parameters`, 4.x reads only `rope_scaling`:
    a config where the two say different things is refused rather than read one way."""
    found = {}
    for key in ("rope_parameters", "rope_scaling"):
        d = cfg.get(key) or {}
        if not isinstance(d, dict):
            raise ValueError(f"{where}: {key} must be a mapping, got {d!r}")
        if d:
            found[key] = None if _rope_type(d) == "default" else _from_dict(d, key, cfg, where)
    values = set(found.values())
    if len(values) > 1:
        raise ValueError(
            f"{where}: rope_parameters {cfg['rope_parameters']} and rope_scaling "
            f"{cfg['rope_scaling']} disagree"
        )
    return values.pop() if values else None
