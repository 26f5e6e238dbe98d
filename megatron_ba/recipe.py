"""Training recipes: one YAML format for every backend, loaded strictly, with key=value overrides.

    recipe = load_recipe("recipes/tiny-cpu.yaml", ["loss.rule=token", "grpo.steps=20"])
    recipe.loss.rule, recipe.to_dict(), recipe.dump(path)

The schema is the dataclass tree below (docs/recipes.md lists every key). Loading is strict: an
unknown key fails with its dotted path named (and the closest known key suggested), a value of the
wrong type fails with the key and the expected type. Overrides use Hydra/NeMo's `a.b.c=value`
syntax; values are parsed as YAML (`x=null`, `x=[1,2]`, `x=1e-4`).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BACKENDS = ("local",)

# Keys a user may expect that no code reads yet: setting one is an error that says so, rather
# than a setting that is silently ignored. Each is added to the schema with the code that reads it.
NOT_IMPLEMENTED = {
    "model.pretrained": "starting from a Hugging Face checkpoint",
    "tokenizer.kind": "choosing the tokenizer, only the task-trained BPE exists",
    "tokenizer.path": "loading a tokenizer from a folder",
    "data.path": "training on a data set file, only the synthetic arithmetic task exists",
    "data.train_prompts": "limiting a real data set's prompt pool",
    "warmstart.enabled": "turning the warm start off, which needs model.pretrained",
    "parallel.sequence_parallel": "sequence parallelism",
}


@dataclass
class ModelSection:
    """A Qwen2-shaped decoder (RMSNorm, SwiGLU, RoPE, GQA, QKV bias, untied output layer)."""

    hidden_size: int = 128
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 384
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02

    def qwen2_spec(self, vocab_size: int):
        """The megatron_ba Qwen2Spec of this shape: the one source of both the megatron-core
        policy and its Hugging Face twin (warm start, vLLM, exports)."""
        from megatron_ba.megatron.model import Qwen2Spec

        return Qwen2Spec(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            ffn_hidden_size=self.ffn_hidden_size,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            norm_eps=self.norm_eps,
            init_std=self.init_std,
        )


@dataclass
class TokenizerSection:
    """A byte-level BPE trained on the task's corpus (nothing downloaded)."""

    vocab_size: int = 320


@dataclass
class DataSection:
    task: str = "arithmetic"  # arithmetic: the synthetic verifiable task of the CPU run
    eval_prompts: int = 128
    min_terms: int = 2
    max_terms: int = 4
    seed: int = 1234


@dataclass
class WarmstartSection:
    """Supervised warm start on a correct/sloppy mixture, cached by its inputs' hash."""

    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    correct_fraction: float = 0.35


@dataclass
class GRPOSection:
    steps: int = 40
    prompts_per_step: int = 32
    group_size: int = 8
    max_new_tokens: int = 64
    temperature: float = 1.0
    mini_batches: int = 1  # optimiser steps per rollout batch (whole groups each)
    normalize_std: bool = True
    std: str = "population"
    drop_zero_variance: bool = False


@dataclass
class LossSection:
    rule: str = "balanced"
    scope: str = "group"
    neutral_eps: float = 0.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    reg_rule: str = "token"
    reg_scope: str = "batch"
    max_length: int | None = None  # dr_grpo's budget; default grpo.max_new_tokens


@dataclass
class ParallelSection:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    micro_batch_size: int = 64  # sequences per micro-batch on each data-parallel rank


@dataclass
class RolloutSection:
    engine: str = "vllm"  # vllm | builtin (slower, only when asked for)
    in_process: bool = False  # vLLM in the trainer's process (single-process runs only)
    kv_cache_gb: float = 1.0
    threads: int | None = None  # torch threads; default: all cores


@dataclass
class OptimizerSection:
    lr: float = 3e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0


@dataclass
class CheckpointSection:
    every: int = 10  # optimiser steps between checkpoints (0: only at the end)
    keep: int = 2


@dataclass
class EvalSection:
    every: int = 10
    samples: int = 4  # k of Acc@k at the sampling temperature
    temperature: float = 1.0


@dataclass
class LoggingSection:
    progress: bool = True
    plots: bool = True


@dataclass
class Recipe:
    name: str = "unnamed"
    backend: str = "local"
    seed: int = 0
    model: ModelSection = field(default_factory=ModelSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    data: DataSection = field(default_factory=DataSection)
    warmstart: WarmstartSection = field(default_factory=WarmstartSection)
    grpo: GRPOSection = field(default_factory=GRPOSection)
    loss: LossSection = field(default_factory=LossSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def dump(self, path: str | Path) -> None:
        import yaml

        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


class RecipeError(ValueError):
    """A recipe that cannot be loaded; the message names the key."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotated type `tp` (int accepted for float)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(path, value, option)
            except RecipeError:
                pass
        names = " or ".join(_type_name(o) for o in options)
        raise RecipeError(f"{path}: expected {names}, got {value!r}")
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        # YAML 1.1 (PyYAML) reads exponents without a dot, like 1e-6, as strings.
        try:
            return float(value)
        except ValueError:
            pass
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp in (str, bool) and isinstance(value, tp):
        return value
    raise RecipeError(f"{path}: expected {_type_name(tp)}, got {value!r}")


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise RecipeError(f"{path or 'recipe'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in fields and where in NOT_IMPLEMENTED:
            raise RecipeError(f"{where}: not implemented yet: {NOT_IMPLEMENTED[where]}; remove it")
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise RecipeError(f"{where}: unknown key{hint}; known keys: {', '.join(fields)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, where)
        else:
            kwargs[key] = _coerce(where, value, tp)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    import yaml

    if "=" not in text:
        raise RecipeError(f"override {text!r}: expected key.path=value")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise RecipeError(f"override {text!r}: empty key")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override {text!r}: {k} is not a section")
        node[keys[-1]] = value
    return data


def validate(recipe: Recipe) -> Recipe:
    """Cross-field checks (types are checked while building)."""
    from megatron_ba.aggregation import RULES, SCOPES

    def need(cond: bool, key: str, msg: str) -> None:
        if not cond:
            raise RecipeError(f"{key}: {msg}")

    need(
        recipe.backend in BACKENDS,
        "backend",
        f"must be one of {', '.join(BACKENDS)} (no other backend is implemented yet)",
    )
    need(recipe.loss.rule in RULES, "loss.rule", f"must be one of {', '.join(RULES)}")
    need(recipe.loss.reg_rule in RULES, "loss.reg_rule", f"must be one of {', '.join(RULES)}")
    need(recipe.loss.scope in SCOPES, "loss.scope", f"must be one of {', '.join(SCOPES)}")
    need(recipe.loss.reg_scope in SCOPES, "loss.reg_scope", f"must be one of {', '.join(SCOPES)}")
    need(recipe.grpo.group_size >= 2, "grpo.group_size", "must be >= 2 (advantages are relative)")
    need(recipe.grpo.prompts_per_step >= 1, "grpo.prompts_per_step", "must be >= 1")
    need(recipe.grpo.temperature > 0, "grpo.temperature", "must be > 0")
    need(
        recipe.grpo.mini_batches >= 1
        and recipe.grpo.prompts_per_step % recipe.grpo.mini_batches == 0,
        "grpo.mini_batches",
        "must be >= 1 and divide grpo.prompts_per_step",
    )
    need(recipe.grpo.std in ("population", "sample"), "grpo.std", "population or sample")
    need(recipe.rollout.engine in ("vllm", "builtin"), "rollout.engine", "vllm or builtin")
    m = recipe.model
    need(
        m.hidden_size % m.num_attention_heads == 0,
        "model.hidden_size",
        "must be divisible by model.num_attention_heads",
    )
    need(
        m.num_attention_heads % m.num_query_groups == 0,
        "model.num_query_groups",
        "must divide model.num_attention_heads",
    )
    p = recipe.parallel
    for k in ("tp", "pp", "cp", "micro_batch_size"):
        need(getattr(p, k) >= 1, f"parallel.{k}", "must be >= 1")
    need(m.num_query_groups % p.tp == 0, "parallel.tp", "must divide model.num_query_groups")
    need(m.num_layers % p.pp == 0, "parallel.pp", "must divide model.num_layers")
    need(recipe.eval.samples >= 1, "eval.samples", "must be >= 1")
    need(
        0.0 <= recipe.warmstart.correct_fraction <= 1.0,
        "warmstart.correct_fraction",
        "must be in [0, 1]",
    )
    return recipe


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe: no such file {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise RecipeError(f"recipe: {path} must hold a mapping at the top level")
    data = apply_overrides(data, list(overrides or []))
    return validate(_build(Recipe, data, ""))
