"""megatron-core (Qwen2-shaped, full-shape TP=1/PP=1 names) <-> Hugging Face Qwen2 weights.

megatron -> HF syncs the trained policy into vLLM after every optimiser step and exports
checkpoints that vLLM, transformers and `megatron-ba eval` load; HF -> megatron starts a policy
from a Hugging Face model (the warm start, or a pretrained model on a cluster). The layouts that
differ:

- fused QKV: megatron stores, for each query group g, its q heads then one k head then one v head
  (rows [g][q_1..q_r, k, v][head_dim]); HF has separate q_proj / k_proj / v_proj with heads in
  group-major order (q head j belongs to kv head j // r), so the split is a reshape per group;
- gated MLP: megatron's `linear_fc1` is [gate; up] stacked along rows -> gate_proj, up_proj;
- names: `decoder.layers.{i}.self_attention.linear_proj` -> `model.layers.{i}.self_attn.o_proj`, ...
  Transformer Engine specs fuse the norms into the next linear (`linear_qkv.layer_norm_weight`,
  `linear_fc1.layer_norm_weight`); both spellings are accepted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def _split_qkv(t: torch.Tensor, heads: int, groups: int, head_dim: int):
    """[groups * (r + 2) * head_dim, ...] -> q [heads * head_dim, ...], k and v."""
    r = heads // groups
    rest = t.shape[1:]
    g = t.reshape(groups, r + 2, head_dim, *rest)
    q = g[:, :r].reshape(heads * head_dim, *rest)
    k = g[:, r].reshape(groups * head_dim, *rest)
    v = g[:, r + 1].reshape(groups * head_dim, *rest)
    return q, k, v


def megatron_to_hf(
    full: dict[str, torch.Tensor], *, num_attention_heads: int, num_query_groups: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF Qwen2 name, tensor) for a full-shape megatron state dict."""
    for name, t in full.items():
        if name == "embedding.word_embeddings.weight":
            yield "model.embed_tokens.weight", t
        elif name == "decoder.final_layernorm.weight":
            yield "model.norm.weight", t
        elif name == "output_layer.weight":
            yield "lm_head.weight", t
        elif m := _LAYER.match(name):
            i, rest = m.group(1), m.group(2)
            p = f"model.layers.{i}."
            if rest in _SIMPLE:
                yield p + _SIMPLE[rest], t
            elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
                kind = rest.rsplit(".", 1)[1]
                hidden = t.shape[0] // (num_attention_heads + 2 * num_query_groups)
                q, k, v = _split_qkv(t, num_attention_heads, num_query_groups, hidden)
                yield p + f"self_attn.q_proj.{kind}", q
                yield p + f"self_attn.k_proj.{kind}", k
                yield p + f"self_attn.v_proj.{kind}", v
            elif rest == "mlp.linear_fc1.weight":
                gate, up = t.chunk(2, dim=0)
                yield p + "mlp.gate_proj.weight", gate
                yield p + "mlp.up_proj.weight", up
            elif rest.endswith("_extra_state"):
                continue
            else:
                raise ValueError(f"full: no Hugging Face name for megatron parameter {name!r}")
        elif name.endswith("_extra_state") or "rotary_pos_emb" in name:
            continue
        else:
            raise ValueError(f"full: no Hugging Face name for megatron parameter {name!r}")


def hf_to_megatron(
    hf: dict[str, torch.Tensor], *, num_attention_heads: int, num_query_groups: int
) -> dict[str, torch.Tensor]:
    """The inverse of `megatron_to_hf` (local-spec names: separate norm parameters)."""
    inverse = {v: k for k, v in _SIMPLE.items() if "layer_norm_weight" not in k}
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in hf.items():
        if name == "model.embed_tokens.weight":
            out["embedding.word_embeddings.weight"] = t
        elif name == "model.norm.weight":
            out["decoder.final_layernorm.weight"] = t
        elif name == "lm_head.weight":
            out["output_layer.weight"] = t
        elif m := re.match(r"^model\.layers\.(\d+)\.(.+)$", name):
            layers.setdefault(m.group(1), {})[m.group(2)] = t
        elif "rotary_emb" not in name:
            raise ValueError(f"hf: no megatron name for Hugging Face parameter {name!r}")
    for i, params in sorted(layers.items(), key=lambda kv: int(kv[0])):
        p = f"decoder.layers.{i}."
        for hf_name, t in params.items():
            if hf_name in inverse:
                out[p + inverse[hf_name]] = t
        for kind in ("weight", "bias"):
            q = params.get(f"self_attn.q_proj.{kind}")
            if q is None:
                continue
            k, v = params[f"self_attn.k_proj.{kind}"], params[f"self_attn.v_proj.{kind}"]
            r = num_attention_heads // num_query_groups
            head_dim = q.shape[0] // num_attention_heads
            rest = q.shape[1:]
            fused = torch.cat(
                [
                    q.reshape(num_query_groups, r, head_dim, *rest),
                    k.reshape(num_query_groups, 1, head_dim, *rest),
                    v.reshape(num_query_groups, 1, head_dim, *rest),
                ],
                dim=1,
            )
            out[p + f"self_attention.linear_qkv.{kind}"] = fused.reshape(-1, *rest)
        out[p + "mlp.linear_fc1.weight"] = torch.cat(
            [params["mlp.gate_proj.weight"], params["mlp.up_proj.weight"]], dim=0
        )
    return out


def qwen2_config(spec, *, eos_token_id: int, bos_token_id: int | None = None) -> dict:
    """config.json of the HF Qwen2 model with `spec`'s shape (a megatron_ba Qwen2Spec)."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_query_groups,
        "head_dim": spec.hidden_size // spec.num_attention_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": float(spec.rope_theta),
        "rms_norm_eps": spec.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "initializer_range": spec.init_std,
        "torch_dtype": "float32",
        "eos_token_id": eos_token_id,
        "bos_token_id": eos_token_id if bos_token_id is None else bos_token_id,
    }


def save_hf_model(out_dir: str | Path, full: dict[str, torch.Tensor], spec, tokenizer) -> Path:
    """Write config.json, model.safetensors, generation_config.json and the tokenizer."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = {
        k: v.detach().to(torch.float32).contiguous()
        for k, v in megatron_to_hf(
            full,
            num_attention_heads=spec.num_attention_heads,
            num_query_groups=spec.num_query_groups,
        )
    }
    save_file(hf, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = qwen2_config(spec, eos_token_id=tokenizer.eos_token_id)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = {"eos_token_id": tokenizer.eos_token_id, "do_sample": True, "temperature": 1.0}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tokenizer.save_pretrained(out)
    return out
