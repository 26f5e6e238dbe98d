"""Building NeMo-Aligner actors on CPU for tests/nemo/ (a tiny GPT, a local tokenizer, gloo).

Everything here runs in .venv-nemo only. `start(rank, world, port, tp)` initialises gloo and
megatron-core's parallel state by hand (in a real run NeMo's strategy does it inside fit).
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import torch

VOCAB = 300  # tokenizer size (byte-level BPE: >= 259); NeMo pads the vocabulary
SEQ = 24


def tokenizer_dir(root: Path) -> Path:
    """A local Hugging Face tokenizer folder (trained here, nothing downloaded)."""
    from megatron_ba.testing.tiny_hf import build_tokenizer

    out = Path(root) / "tokenizer"
    if not (out / "tokenizer.json").is_file():
        build_tokenizer(vocab_size=VOCAB).save_pretrained(out)
    return out


def actor_config(
    tok_dir: Path, *, tp: int = 1, mbs: int = 2, gbs: int = 6, grpo: dict | None = None
):
    """A 2-layer GPT (hidden 64, rmsnorm, swiglu, rope) in NeMo-Aligner's model config layout."""
    from omegaconf import OmegaConf

    cfg = {
        "mcore_gpt": True,
        "transformer_engine": False,
        "use_cpu_initialization": True,
        "precision": 32,
        "megatron_amp_O2": False,
        "micro_batch_size": mbs,
        "global_batch_size": gbs,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": 1,
        "encoder_seq_length": SEQ,
        "max_position_embeddings": SEQ,
        "num_layers": 2,
        "hidden_size": 64,
        "ffn_hidden_size": 128,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "init_method_std": 0.02,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "ffn_dropout": 0.0,
        "normalization": "rmsnorm",
        "activation": "fast-swiglu",
        "position_embedding_type": "rope",
        "bias": False,
        "share_embeddings_and_output_weights": False,
        "make_vocab_size_divisible_by": 160,  # 300 -> 320 at TP=1 and TP=2 alike
        "masked_softmax_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_add_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
        "seed": 1234,
        "tokenizer": {"library": "huggingface", "type": str(tok_dir), "use_fast": True},
        "data": {"data_prefix": None, "index_mapping_dir": None},
        "optim": {"name": "adamw", "lr": 1e-2, "weight_decay": 0.0, "betas": [0.9, 0.98]},
        "reinforce": {
            "forward_micro_batch_size": mbs,
            "offload_adam_states": False,
            "num_rollout_samples": 4,
            "rollout_micro_batch_size": 2,
            "sampling_params": {
                "use_greedy": False,
                "temperature": 1.0,
                "top_k": 0,
                "top_p": 1.0,
                "repetition_penalty": 1.0,
                "add_BOS": False,
                "all_probs": False,
                "compute_logprob": False,
                "end_strings": ["<|endoftext|>"],
            },
            "length_params": {"max_length": 8, "min_length": 1},
            "trt_llm": {"enable": False},
        },
        "grpo": grpo or {},
    }
    return OmegaConf.create(cfg)


def start(rank: int, world: int, port: int, tp: int) -> None:
    """gloo + megatron-core parallel state + the CPU shims (call first in every process)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    from megatron_ba.integrations.nemo_aligner import cpu_shims

    cpu_shims.install()
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, 1)


def build(cls, cfg):
    """cls(cfg, trainer) with a CPU Lightning trainer (NeMo's NLPDDPStrategy)."""
    from lightning.pytorch import Trainer
    from nemo.collections.nlp.parts.nlp_overrides import NLPDDPStrategy

    # devices = the gloo world: NeMo derives its (fake) parallel state from the trainer's world
    # size; LOCAL_RANK in the environment tells Lightning the processes exist already.
    devices = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = Trainer(
        strategy=NLPDDPStrategy(),
        accelerator="cpu",
        devices=devices,
        num_nodes=1,
        logger=False,
        enable_checkpointing=False,
        max_steps=1,
    )
    model = cls(cfg, trainer)
    return model


def full_weights(model, tp: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic full-shape (TP=1) weights for every parameter of `model`, by name.

    The full shape is the local one with the partitioned dimension times TP, so every TP layout
    builds the same full tensors; norms near 1, matrices N(0, 0.05).
    """
    out = {}
    for name, p in model.model.named_parameters():
        shape = list(p.shape)
        if getattr(p, "tensor_model_parallel", False):
            shape[int(p.partition_dim)] *= tp
        g = torch.Generator().manual_seed(seed * 1000003 + zlib.crc32(name.encode()))
        t = torch.randn(shape, generator=g, dtype=torch.float64)
        out[name] = (1.0 + 0.1 * t) if "layernorm" in name else 0.05 * t
    return out
