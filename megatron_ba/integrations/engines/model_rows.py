"""The engines' table, its first rows: the recipe's top-level keys, `model.*` and `tokenizer.*`.

Each row: recipe key -> Row(verl cell, NeMo-RL cell, NeMo-Aligner cell) (cells.py says what a
cell holds). verl's keys are those of its ppo_megatron_trainer config, NeMo-RL's of its stock
grpo_math_1B_megatron.yaml, NeMo-Aligner's of conf/gpt_grpo_balanced.yaml.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_ba.integrations.engines.cells import Absent, Dropped, Need, Put, Row, Set, put
from megatron_ba.model_shape import ModelShape

# verl's actor and its megatron section; NeMo-RL's policy's megatron section
A, M = "actor_rollout_ref.actor", "actor_rollout_ref.actor.megatron"
R = "actor_rollout_ref.rollout"
MC, GEN = "policy.megatron_cfg", "policy.generation"
# The model keys a checkpoint's own config decides under an engine (the .nemo file's under
# NeMo-Aligner, whose RoPE scaling is refused there: it would be silently the file's).
SHAPE_KEYS = tuple(
    f"model.{k}"
    for k in (
        "hidden_size",
        "num_layers",
        "num_attention_heads",
        "num_query_groups",
        "ffn_hidden_size",
        "max_position_embeddings",
        "rope_theta",
        "norm_eps",
        "num_experts",
        "moe_router_topk",
        "moe_ffn_hidden_size",
        "moe_aux_loss_coeff",
    )
)
ROPE_KEYS = tuple(
    f"model.rope_scaling.{k}" for k in ("type", "factor", "original_max_position_embeddings")
)
ROPE_REFUSED = (
    "model.rope_scaling: the nemo_aligner backend restores a .nemo whose own config decides the "
    "position embedding (this translation writes no RoPE scaling); leave it out"
)
NEMO_DECIDES = "the restored .nemo file's own config decides the model"


def shape(engine: str) -> str:
    return f"the checkpoint's config.json decides the model under {engine}; leave it out"


def warm_start(engine: str) -> str:
    return (
        f"the local backend's warm start of a fresh tiny model ({engine} starts from "
        "model.pretrained)"
    )


def _hf_folder(job) -> bool:
    """A Hugging Face checkpoint: the model verl and NeMo-RL start from."""
    path = job.model.pretrained
    return path is not None and not str(path).endswith(".nemo")


def gated_deltanet(job) -> bool | None:
    """Whether model.pretrained has Gated DeltaNet layers (Qwen3.5), as its config.json says
    (ModelShape.from_hf_config); None where that file is not readable here or not a model the
    shape reads (the engine then keeps its own default)."""
    if not _hf_folder(job):
        return None
    config = Path(job.model.pretrained, "config.json")
    try:
        cfg = json.loads(config.read_text())
        return ModelShape.from_hf_config(cfg, str(job.model.pretrained)).has_linear_attention
    except (OSError, ValueError):
        return None


# verl's megatron engine packs micro-batches (THD, `use_remove_padding: True` by default);
# megatron-core 0.16.1's GatedDeltaNet raises on packed sequences (and ignores the attention
# mask, so its state would run on across them): a Gated DeltaNet model trains on padded (BSHD)
# micro-batches, as verl's own Qwen3.5 example (examples/grpo_trainer/run_qwen3_5-35b-megatron.sh)
# sets it. The reference model's setting follows the actor's (oc.select in verl's config).
_PADDED_FOR_DELTANET = Set(
    f"{M}.use_remove_padding",
    False,
    when=lambda j: gated_deltanet(j) is True,
)


def _restore(job) -> str:
    """The .nemo file NeMo-Aligner restores, or `???` (OmegaConf's "mandatory, missing":
    train_grpo fails until it is given) where there is none or it is printed for a Hugging
    Face folder (the user converts it)."""
    path = job.model.pretrained
    if path is None or (not str(path).endswith(".nemo") and job.hf_checkpoint == "placeholder"):
        return "???"
    return path


def _restorable(job) -> bool:
    path = job.model.pretrained
    return path is None or str(path).endswith(".nemo") or job.hf_checkpoint == "placeholder"


def _is_bf16(job) -> bool:
    return job.model.precision == "bf16"


def _own_spec(engine: str) -> Need:
    return Need(
        lambda j: j.model.transformer_impl != "local",
        f"{engine}'s megatron builds its own layer spec (Transformer Engine); use auto",
    )


_OWN_SPEC_DOC = "auto / transformer_engine ({}'s megatron builds its own spec); local refused"
_PROMPT_FILES = "the prompt files (RUN_DIR/data/*.jsonl: the local backend's prompt stream)"

ROWS: dict[str, Row] = {
    "name": Row(
        put("trainer.experiment_name"),
        put("logger.wandb.name"),
        Dropped("it names the default run folder, runs/<name>-<rule> (`--run-dir`)"),
    ),
    "backend": Row(
        Put(doc="verl: this translation"),
        Put(doc="nemo_rl: this translation"),
        Put(doc="nemo_aligner: this translation"),
    ),
    "seed": Row(
        put(f"{M}.seed", f"{R}.seed", "data.seed"),
        put("grpo.seed", note="NeMo-RL's set_seed in setup; data.train.seed follows it"),
        put(
            Set("model.seed", lambda j: j.seed + 1),
            note="seed + 1: NeMo refuses 0, which the shipped recipes use",
        ),
    ),
    "model.pretrained": Row(
        put(
            "actor_rollout_ref.model.path",
            _PADDED_FOR_DELTANET,
            doc="actor_rollout_ref.model.path (a Hugging Face folder; .nemo refused); "
            f"{M}.use_remove_padding=false where its config.json has Gated DeltaNet layers "
            "(Qwen3.5: padded micro-batches, megatron-core's GatedDeltaNet takes no packed ones)",
            need=Need(
                _hf_folder,
                lambda j: f"verl starts from a Hugging Face folder, got {j.model.pretrained!r}",
            ),
        ),
        put(
            "policy.model_name",
            note="a Hugging Face folder or id; .nemo refused",
            need=Need(
                _hf_folder,
                lambda j: (
                    f"NeMo-RL starts from a Hugging Face folder or id, got {j.model.pretrained!r}"
                ),
            ),
        ),
        put(
            Set("pretrained_checkpoint.restore_from_path", _restore),
            note="a .nemo file; a Hugging Face folder: refused when launching, `???` when "
            "printing, to be converted first",
            need=Need(
                _restorable,
                lambda j: (
                    "NeMo-Aligner restores a .nemo checkpoint, got "
                    f"{j.model.pretrained!r}; convert a Hugging Face model with NeMo's "
                    "converter first (docs/nemo-aligner.md)"
                ),
            ),
        ),
    ),
    **{
        key: Row(Absent(shape("verl")), Absent(shape("NeMo-RL")), Dropped(NEMO_DECIDES))
        for key in SHAPE_KEYS
    },
    **{
        key: Row(
            Absent(shape("verl")),
            Absent(shape("NeMo-RL")),
            Absent(
                "the restored .nemo file's own config decides the position embedding",
                said=lambda j: ROPE_REFUSED,
            ),
        )
        for key in ROPE_KEYS
    },
    "model.preset": Row(
        Absent(warm_start("verl")),
        Absent(warm_start("NeMo-RL")),
        Dropped(NEMO_DECIDES),
    ),
    "model.init_std": Row(
        Absent(warm_start("verl")),
        Absent(warm_start("NeMo-RL")),
        Dropped("the local backend's initialisation of a fresh model (NeMo-Aligner restores one)"),
    ),
    "model.precision": Row(
        Put(
            needs=(
                Need(
                    _is_bf16,
                    lambda j: (
                        "verl's megatron trainer trains in bf16 "
                        f"(megatron.dtype), got {j.model.precision!r}"
                    ),
                ),
            ),
            doc=f"bf16 only ({M}.dtype is bfloat16); fp32 refused",
        ),
        Put(
            (Set("policy.precision", "bfloat16"),),
            (
                Need(
                    _is_bf16,
                    lambda j: (
                        f"NeMo-RL's megatron policy here trains in bf16, got {j.model.precision!r}"
                    ),
                ),
            ),
            doc="bf16 only (policy.precision=bfloat16); fp32 refused",
        ),
        put(
            Set("trainer.precision", lambda j: "bf16" if j.model.precision == "bf16" else 32),
            Set("model.megatron_amp_O2", lambda j: j.model.precision == "bf16"),
            doc="trainer.precision (bf16 or 32), model.megatron_amp_O2 (bf16: fp32 master "
            "weights); with --accelerator cpu fp32 only",
            need=Need(
                lambda j: j.accelerator != "cpu" or j.model.precision == "fp32",
                lambda j: (
                    f"the nemo_aligner backend on CPU trains in fp32, got {j.model.precision!r}"
                ),
            ),
        ),
    ),
    "model.transformer_impl": Row(
        Put(needs=(_own_spec("verl"),), doc=_OWN_SPEC_DOC.format("verl")),
        Put(needs=(_own_spec("NeMo-RL"),), doc=_OWN_SPEC_DOC.format("NeMo-RL")),
        Dropped("NeMo's GPT model builds its own layer spec"),
    ),
    "model.attention": Row(
        Absent("the local spec's core attention (verl's megatron uses its own)"),
        Absent("the local spec's core attention (NeMo-RL's megatron uses its own)"),
        Dropped("the local spec's core attention (NeMo's GPT model uses its own)"),
    ),
    "tokenizer.kind": Row(
        Put(doc="hf (required with model.pretrained)"),
        Put(doc="hf (required with model.pretrained)"),
        Put(
            doc=f"{_PROMPT_FILES}: a math recipe renders them with the hf tokenizer's chat template"
        ),
    ),
    "tokenizer.vocab_size": Row(
        Absent("the trained BPE's (verl uses the checkpoint's tokenizer)"),
        Absent("the trained BPE's (NeMo-RL uses the checkpoint's tokenizer)"),
        Dropped("the trained BPE's (the .nemo file holds its own tokenizer)"),
    ),
    "tokenizer.path": Row(
        put(
            Set(
                "actor_rollout_ref.model.tokenizer_path",
                when=lambda j: j.tokenizer.path is not None,
            )
        ),
        put(Set("policy.tokenizer.name", when=lambda j: j.tokenizer.path is not None)),
        Put(doc=f"{_PROMPT_FILES}: the folder whose chat template renders a math recipe's"),
    ),
}
