"""The supported families, and the spec <-> config.json entry points that dispatch to them.

spec = spec_from_hf_config(json.load(open(DIR / "config.json")))   # or spec_from_hf_dir(DIR)
cfg = hf_config_from_spec(spec, base=source_config)                 # config.json to write
table = table_for(spec)                                            # the family's name table
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_ba.conversion import qwen2, qwen3, qwen3_moe
from megatron_ba.conversion.family_table import FamilyTable

FAMILY_MODULES = {"qwen2": qwen2, "qwen3": qwen3, "qwen3_moe": qwen3_moe}  # model_type -> module


def _module(family: str):
    if family not in FAMILY_MODULES:
        raise ValueError(
            f"model_type: {family!r} is not supported (supported: {sorted(FAMILY_MODULES)})"
        )
    return FAMILY_MODULES[family]


def table_for(spec) -> FamilyTable:
    return _module(spec.family).TABLE


def spec_from_hf_config(cfg: dict, **changes):
    """The ModelSpec of a Hugging Face config.json (a dict); `changes` override spec fields
    (e.g. params_dtype=torch.float32 to train a bfloat16 checkpoint in float32)."""
    return _module(cfg.get("model_type")).spec_from_config(cfg, **changes)


def spec_from_hf_dir(model_dir: str | Path, **changes):
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model_dir: {str(model_dir)!r} has no config.json")
    return spec_from_hf_config(json.loads(path.read_text()), **changes)


def hf_config_from_spec(spec, base: dict | None = None, **fields) -> dict:
    """config.json for `spec`'s family; `base` (the source's config) keeps the fields a spec does
    not hold; `fields` (e.g. eos_token_id) are set last."""
    if base is not None and base.get("model_type") not in (None, table_for(spec).model_type):
        raise ValueError(
            f"base: a {base.get('model_type')!r} config cannot describe a {spec.family!r} model"
        )
    cfg = _module(spec.family).config_from_spec(spec, base)
    cfg.update(fields)
    return cfg
