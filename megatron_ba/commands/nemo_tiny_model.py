"""`megatron-ba nemo-tiny-model OUT`: a tiny NeMo GPT checkpoint and arithmetic prompts, made
here, for NeMo-Aligner runs on CPU (scripts/nemo_demo.sh, tests/nemo/).

    python -m megatron_ba.cli nemo-tiny-model OUT [key=value ...] [--recipe R] [--cache-dir C]
    python -m megatron_ba.cli nemo-tiny-model runs/nemo-model warmstart.steps=150   # quicker

Writes OUT/model.nemo (NeMo's own `save_to` of a `MegatronGPTModel`), OUT/hf/ (the same
weights as a Hugging Face folder, whose tokenizer the checkpoint's `tokenizer.type` names),
OUT/train.jsonl and OUT/val.jsonl (`{"prompt", "ground_truth"}` lines of the recipe's synthetic
task: train prompts and the held-out ones) and OUT/DONE. The weights are the local backend's
warm start of the recipe (megatron_ba.train.warmstart, cached under --cache-dir, default
~/.cache/megatron-ba), converted from its Hugging Face folder with megatron_ba.conversion, so
GRPO starts from a policy that is right some of the time and both backends can start from the
same one. Run it in .venv-nemo (NeMo 2.1); it is cached: an OUT whose DONE names the same warm
start is kept.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from megatron_ba.train import warmstart_cache

DEFAULT_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"
NUM_TRAIN_PROMPTS = 4096
LAYOUT = "model.nemo hf/ train.jsonl val.jsonl"  # in DONE: a folder of another layout is remade


def nemo_model_config(spec, tokenizer_dir: Path) -> dict:
    """NeMo 2.1's `model` config of a megatron-core GPT with `spec`'s shape (local layer spec,
    fp32, CPU initialisation, no fusions, dropout 0). The vocabulary pads by half its size, so
    NeMo's padding (a multiple of make_vocab_size_divisible_by x TP) leaves it unchanged at TP 1
    and 2 and the embedding's shape, hence the checkpoint, does not depend on the layout."""
    if spec.vocab_size % 2:
        raise ValueError(f"spec.vocab_size: {spec.vocab_size} is odd; NeMo would pad it per TP")
    if spec.rope_scaling is not None:
        raise ValueError(
            f"spec.rope_scaling: {spec.rope_scaling.type} is not written into NeMo's config here "
            "(plain RoPE only)"
        )
    fusions_off = dict.fromkeys(
        ("masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_add_fusion",
         "apply_rope_fusion", "gradient_accumulation_fusion", "persist_layer_norm"), False
    )  # fmt: skip
    recompute = dict.fromkeys(
        ("activations_checkpoint_granularity", "activations_checkpoint_method",
         "activations_checkpoint_num_layers", "activations_checkpoint_layers_per_pipeline",
         "num_micro_batches_with_partial_activation_checkpoints")
    )  # fmt: skip
    return {
        "mcore_gpt": True, "transformer_engine": False, "use_cpu_initialization": True,
        "precision": 32, "megatron_amp_O2": False, "micro_batch_size": 1,
        "global_batch_size": 1, "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1, "sequence_parallel": False,
        "gradient_as_bucket_view": True,
        "encoder_seq_length": spec.max_position_embeddings,
        "max_position_embeddings": spec.max_position_embeddings,
        "num_layers": spec.num_layers, "hidden_size": spec.hidden_size,
        "ffn_hidden_size": spec.ffn_hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_query_groups": spec.num_query_groups, "kv_channels": spec.kv_channels,
        "init_method_std": 0.02, "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "ffn_dropout": 0.0, "normalization": "rmsnorm", "layernorm_epsilon": spec.norm_eps,
        "activation": "fast-swiglu", "position_embedding_type": "rope",
        "rotary_base": spec.rope_theta, "bias": False, "qkv_bias": spec.qkv_bias,
        "share_embeddings_and_output_weights": spec.tie_word_embeddings,
        "make_vocab_size_divisible_by": spec.vocab_size // 2, "seed": 1234,
        "tokenizer": {"library": "huggingface", "type": str(tokenizer_dir), "use_fast": True},
        "data": {"data_prefix": None, "index_mapping_dir": None},
        "optim": {"name": "adamw", "lr": 1e-4},
        **fusions_off, **recompute,
    }  # fmt: skip


def save_nemo(hf_dir: Path, out: Path) -> Path:
    """OUT/model.nemo and OUT/hf/ with the weights of the Hugging Face folder `hf_dir` (a world
    of one)."""
    import torch
    from megatron.core import parallel_state
    from omegaconf import OmegaConf

    from megatron_ba.conversion import spec_from_hf_dir
    from megatron_ba.integrations.nemo_aligner import cpu_shims
    from megatron_ba.parallel.world import join_world

    if not torch.cuda.is_available():
        cpu_shims.install()
    join_world("gloo")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    from lightning.pytorch import Trainer
    from nemo.collections.nlp.models.language_modeling.megatron_gpt_model import MegatronGPTModel
    from nemo.collections.nlp.parts.nlp_overrides import NLPDDPStrategy

    spec = spec_from_hf_dir(hf_dir)
    shutil.copytree(hf_dir, out / "hf", dirs_exist_ok=True, ignore=_not_the_model)
    cfg = OmegaConf.create(nemo_model_config(spec, (out / "hf").resolve()))
    trainer = Trainer(strategy=NLPDDPStrategy(), accelerator="cpu", devices=1, logger=False,
                      enable_checkpointing=False)  # fmt: skip
    model = MegatronGPTModel(cfg, trainer)
    load_hf_weights(model, hf_dir, spec)
    model.save_to(str(out / "model.nemo"))
    return out / "model.nemo"


def load_hf_weights(model, hf_dir: Path, spec) -> None:
    """The Hugging Face folder's weights into a NeMo GPT model built for `spec` (TP=1: the
    full megatron-core state dict); ValueError unless every parameter is matched."""
    from megatron_ba.conversion import megatron_state_dict_from_hf

    weights = megatron_state_dict_from_hf(hf_dir, spec)
    missing, unexpected = model.model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"hf_dir: weights do not match NeMo's model: missing {missing}, "
                         f"unexpected {unexpected}")  # fmt: skip


def _not_the_model(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n in ("DONE", "warmstart.json")]  # the warm-start cache's marks


def make(out: str | Path, recipe_path: str | Path = DEFAULT_RECIPE, overrides=(),
         cache_dir: str | Path | None = None) -> Path:  # fmt: skip
    """OUT with model.nemo, hf/, train.jsonl, val.jsonl (kept if already made alike)."""
    from megatron_ba.recipe import load_recipe
    from megatron_ba.train.prompt_files import write_prompt_files
    from megatron_ba.train.warmstart import cache_key, run_warmstart

    out = Path(out)
    recipe = load_recipe(recipe_path, list(overrides))
    key = f"{cache_key(recipe)} {LAYOUT}"
    if (out / "DONE").is_file() and (out / "DONE").read_text().strip() == key:
        print(f"nemo-tiny-model: {out} holds this warm start already; kept")
        return out
    hf_dir = run_warmstart(recipe, Path(cache_dir or warmstart_cache()).expanduser())
    out.mkdir(parents=True, exist_ok=True)
    (out / "DONE").unlink(missing_ok=True)
    shutil.rmtree(out / "model_weights", ignore_errors=True)  # NeMo's scratch folder
    save_nemo(hf_dir, out)
    write_prompt_files(recipe, out, train_prompts=NUM_TRAIN_PROMPTS)
    (out / "DONE").write_text(key + "\n")
    print(f"nemo-tiny-model: wrote {out}/model.nemo, train.jsonl, val.jsonl")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", type=Path, help="the folder to write")
    p.add_argument("--recipe", default=str(DEFAULT_RECIPE), help="the local recipe to warm-start")
    p.add_argument("--cache-dir", default=None, help="warm-start cache (default: train's)")
    p.add_argument("overrides", nargs="*", help="recipe key=value overrides")


def run(args: argparse.Namespace) -> int:
    make(args.out, args.recipe, args.overrides, args.cache_dir)
    return 0
