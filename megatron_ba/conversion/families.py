"""The supported families, and the spec <-> config.json entry points that dispatch to them.

spec = spec_from_hf_config(json.load(open(DIR / "config.json")))   # or spec_from_hf_dir(DIR)
cfg = hf_config_from_spec(spec, base=source_config)                 # config.json to write
table = table_for(spec)                                            # the family's name table
table = table_for(spec, hf_config=cfg)     # its HF names in the layout of that checkpoint

A family module registers under every model_type its checkpoints use (Qwen3.5's text layout
`qwen3_5_text` and its ConditionalGeneration layout `qwen3_5` are one family, "qwen3_5"). Where a
family's layouts name the language model's tensors differently (Qwen3.5: `model.` or
`model.language_model.`), the module's `hf_prefix(cfg)` says which a config.json describes.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_ba.conversion import qwen2, qwen3, qwen3_5, qwen3_5_moe, qwen3_moe
from megatron_ba.conversion.family_table import FamilyTable

# model_type -> module
FAMILY_MODULES = {
    "qwen2": qwen2,
    "qwen3": qwen3,
    "qwen3_moe": qwen3_moe,
    "qwen3_5": qwen3_5,
    "qwen3_5_text": qwen3_5,
    "qwen3_5_moe": qwen3_5_moe,
    "qwen3_5_moe_text": qwen3_5_moe,
}


def _module(family: str):
    if family not in FAMILY_MODULES:
        raise ValueError(
            f"model_type: {family!r} is not supported (supported: {sorted(FAMILY_MODULES)})"
        )
    return FAMILY_MODULES[family]


def table_for(spec, hf_config: dict | None = None) -> FamilyTable:
    """The family's name table; with `hf_config` (a checkpoint's config.json), its HF names in
    that checkpoint's layout (default: the text layout, `model.`)."""
    module = _module(spec.family)
    if hf_config is None or not hasattr(module, "hf_prefix"):
        return module.TABLE
    return module.TABLE.with_prefix(module.hf_prefix(hf_config))


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
    module = _module(spec.family)
    if base is not None and base.get("model_type") is not None:
        if FAMILY_MODULES.get(base["model_type"]) is not module:
            raise ValueError(
                f"base: a {base.get('model_type')!r} config cannot describe a {spec.family!r} model"
            )
    cfg = module.config_from_spec(spec, base)
    cfg.update(fields)
    return cfg
