"""The gloo worker of tests/test_sdpa_attention.py: SDPA vs megatron-core's unfused core attention.

One world of 2 ranks runs TP=2, then TP=1 (DP=2) after re-initialising the parallel state; every
rank saves its findings (max differences) and the test asserts on them. In float64:

* the core alone: both cores on this rank's heads and groups of the same full q/k/v, with the
  explicit causal mask megatron_ba's step passes, with no mask (the causal mask type), and with a
  left-padding mask; outputs and the gradients of q, k and v, each against an independent float64
  reference (`reference_attention`). Controls: a non-causal SDPA core and one with a wrong scale;
* the whole model: the tiny Qwen2 GPTModel (float64 parameters, norm weights excepted) built
  with each core and the same weights; logits and every parameter's gradient of a fixed linear
  function of the logits, and the project's GRPO step (loss, full gathered gradients). Control:
  the SDPA model with a softmax scale 1.25 times the right one.
"""

from __future__ import annotations

import math

import torch

SEQ, BATCH, HEAD_DIM = 12, 2, 8
SHAPES = {"mha": (4, 4), "gqa": (4, 2), "gqa4": (8, 2)}  # (heads, query groups)


def reference_attention(q, k, v, cut, scale):
    """float64 softmax(q k^T scale, cut -> -inf) v per head; q [s, b, h, d], k/v [s, b, g, d];
    cut [b or 1, 1, s, s] True where cut (a row cut everywhere: uniform, as megatron-core)."""
    h, g = q.shape[2], k.shape[2]
    k, v = (t.repeat_interleave(h // g, dim=2) for t in (k, v))
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    full = cut.expand(scores.shape)
    scores = scores.masked_fill(full, float("-inf"))
    scores = torch.where(full.all(-1, keepdim=True), torch.zeros_like(scores), scores)
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhst,tbhd->sbhd", probs, v)
    return out.reshape(out.shape[0], out.shape[1], -1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _full_qkv(heads: int, groups: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(SEQ, BATCH, heads, HEAD_DIM, generator=g, dtype=torch.float64)
    k = torch.randn(SEQ, BATCH, groups, HEAD_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(SEQ, BATCH, groups, HEAD_DIM, generator=g, dtype=torch.float64)
    w = torch.randn(SEQ, BATCH, heads * HEAD_DIM, generator=g, dtype=torch.float64)
    return q, k, v, w


def _run_core(core, inputs, mask):
    """Output, dq, dk, dv of sum(core(q, k, v, mask) * w) for inputs (q, k, v, w)."""
    q, k, v, w = inputs
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = core(*leaves, mask)
    (out * w).sum().backward()
    return [out.detach(), *(t.grad for t in leaves)]


def _diff(a: list, b: list) -> float:
    """Max relative difference over output and q/k/v gradients of two `_run_core` results."""
    return max(_rel(x, y) for x, y in zip(a, b, strict=True))


def _config(heads: int, groups: int, tp: int, **changes):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=1,
        hidden_size=heads * HEAD_DIM,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=HEAD_DIM,
        tensor_model_parallel_size=tp,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        masked_softmax_fusion=False,
        params_dtype=torch.float64,
        use_cpu_initialization=True,
    )
    fields.update(changes)
    return TransformerConfig(**fields)


def core_findings(tp: int, rank: int) -> dict:
    """Both cores against the reference on this rank's share of the heads."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ba.megatron.batching import causal_mask
    from megatron_ba.megatron.sdpa_attention import SDPAttention

    found = {}
    causal = causal_mask(SEQ)
    valid = torch.ones(BATCH, SEQ, dtype=torch.bool)
    valid[0, :3] = False  # row 0: 3 left-padding positions (queries that attend to no key)
    padded = causal_mask(SEQ, valid=valid)
    scale = 1 / math.sqrt(HEAD_DIM)
    for name, (heads, groups) in SHAPES.items():
        q, k, v, w = _full_qkv(heads, groups, seed=7)
        hp, gp = heads // tp, groups // tp
        mine = (
            q[:, :, rank * hp : (rank + 1) * hp],
            k[:, :, rank * gp : (rank + 1) * gp],
            v[:, :, rank * gp : (rank + 1) * gp],
            w[:, :, rank * hp * HEAD_DIM : (rank + 1) * hp * HEAD_DIM],
        )
        config = _config(heads, groups, tp)
        unfused = DotProductAttention(config, 1, AttnMaskType.causal, "self")
        sdpa = SDPAttention(config, 1, AttnMaskType.causal, "self")
        no_mask = SDPAttention(config, 1, AttnMaskType.no_mask, "self")
        wrong_scale = SDPAttention(
            config, 1, AttnMaskType.causal, "self", softmax_scale=1.25 * scale
        )
        runs = {}
        for label, cut in (("causal", causal), ("padded", padded)):
            runs[f"reference_{label}"] = _run_core(
                lambda a, b, c, _m, cut=cut: reference_attention(a, b, c, cut, scale), mine, None
            )
            runs[f"unfused_{label}"] = _run_core(unfused, mine, cut)
            runs[f"sdpa_{label}"] = _run_core(sdpa, mine, cut)
        runs["sdpa_none"] = _run_core(sdpa, mine, None)  # the causal mask type, no mask
        runs["control_non_causal"] = _run_core(no_mask, mine, None)
        runs["control_scale"] = _run_core(wrong_scale, mine, causal)
        # apply_query_key_layer_scaling (layer 3): the unfused core divides the scale by 3 and
        # multiplies the scores back in its softmax; SDPA ignores it. Both: the same function.
        scaled = _config(heads, groups, tp, apply_query_key_layer_scaling=True)
        for core, module in (("unfused", DotProductAttention), ("sdpa", SDPAttention)):
            layer3 = module(scaled, 3, AttnMaskType.causal, "self")
            runs[f"layer_scaled_{core}"] = _run_core(layer3, mine, causal)
        ref, unf = runs["reference_causal"], runs["unfused_causal"]
        found[name] = {
            "heads_on_rank": hp,
            "unfused_vs_reference": _diff(unf, ref),
            "sdpa_vs_reference": _diff(runs["sdpa_causal"], ref),
            "sdpa_vs_unfused": _diff(runs["sdpa_causal"], unf),
            "sdpa_no_mask_vs_unfused": _diff(runs["sdpa_none"], unf),
            "padded_unfused_vs_reference": _diff(runs["unfused_padded"], runs["reference_padded"]),
            "padded_sdpa_vs_unfused": _diff(runs["sdpa_padded"], runs["unfused_padded"]),
            "control_non_causal_vs_unfused": _diff(runs["control_non_causal"], unf),
            "control_scale_vs_unfused": _diff(runs["control_scale"], unf),
            "layer_scaled_unfused_vs_unfused": _diff(runs["layer_scaled_unfused"], unf),
            "layer_scaled_sdpa_vs_unfused": _diff(runs["layer_scaled_sdpa"], unf),
        }
    return found


def _grpo_batch(vocab: int, seq: int):
    from megatron_ba.megatron.batching import GRPOBatch

    g = torch.Generator().manual_seed(3)
    mask = torch.zeros(4, seq, dtype=torch.bool)
    for i, end in enumerate((seq, seq - 3, seq - 5, seq - 1)):
        mask[i, 4:end] = True
    return GRPOBatch(
        tokens=torch.randint(0, vocab, (4, seq), generator=g),
        response_mask=mask,
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        group_ids=torch.tensor([0, 0, 1, 1]),
        old_logprobs=-torch.rand(4, seq, generator=g),
    )


def _model_run(spec, attention: str, full: dict, rank: int, tp: int, **config_changes) -> dict:
    """Logits and gradients of one build: direct float64, and through the GRPO step."""
    from megatron_ba.megatron import model as mm
    from megatron_ba.megatron.batching import causal_mask
    from megatron_ba.megatron.build_options import BuildOptions
    from megatron_ba.megatron.grpo_step import MicroBatchSpec, forward_backward
    from megatron_ba.parallel import full_shape
    from megatron_ba.step_settings import StepSettings

    config = mm.transformer_config(spec, **config_changes)
    layer_spec = BuildOptions(attention=attention).layer_spec(spec)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, spec.vocab_size, (3, 16), generator=g)
    weight = torch.randn(3, 16, spec.vocab_size, generator=g, dtype=torch.float64)
    shard = spec.vocab_size // tp
    weight = weight[..., rank * shard : (rank + 1) * shard]
    (plain,) = mm.build_model_chunks(spec, ddp=False, config=config, layer_spec=layer_spec)
    full_shape.load_full_state_dict([plain], full)
    logits = plain(tokens, torch.arange(16).expand(3, 16), causal_mask(16))
    (logits * weight).sum().backward()
    chunks = mm.build_model_chunks(spec, config=config, layer_spec=layer_spec)
    full_shape.load_full_state_dict(chunks, full)
    step = forward_backward(
        chunks, _grpo_batch(spec.vocab_size, 20), StepSettings(), MicroBatchSpec(), num_groups=2
    )
    core = type(plain.decoder.layers[0].self_attention.core_attention).__name__
    return {
        "core": core,
        "logits": logits.detach(),
        "grads": {n: p.grad.clone() for n, p in plain.named_parameters()},
        "loss": step.loss,
        "step_grads": full_shape.gather_full_state_dict(chunks, grads=True),
        "keys": sorted(chunks[0].state_dict()),
    }


def _max_rel(a: dict, b: dict) -> float:
    return max(_rel(a[k].double(), b[k].double()) for k in b)


def model_findings(tp: int, rank: int) -> dict:
    """The tiny GPTModel with each core: logits, gradients, GRPO loss and gradients."""
    from megatron_ba.megatron import model as mm

    spec = mm.tiny_qwen2_spec(params_dtype=torch.float64)
    full = mm.full_init_state_dict(spec, 0)
    unfused = _model_run(spec, "unfused", full, rank, tp)
    sdpa = _model_run(spec, "sdpa", full, rank, tp)
    control = _model_run(spec, "sdpa", full, rank, tp, softmax_scale=1.25 / math.sqrt(16))
    out = {
        "cores": (unfused["core"], sdpa["core"]),
        "logits_dtype": str(sdpa["logits"].dtype),
        "same_keys": unfused["keys"] == sdpa["keys"],
        "num_grads": len(sdpa["grads"]),
    }
    for name, run in (("sdpa", sdpa), ("control", control)):
        out[name] = {
            "logits": _rel(run["logits"], unfused["logits"]),
            "grads": _max_rel(run["grads"], unfused["grads"]),
            "loss": abs(run["loss"] - unfused["loss"]) / abs(unfused["loss"]),
            "step_grads": _max_rel(run["step_grads"], unfused["step_grads"]),
        }
    return out


def worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    from megatron_ba.parallel import collectives

    collectives.init_process_group("gloo", rank=rank, world_size=world, port=port)
    from megatron_ba.megatron import cpu_compat

    cpu_compat.install()
    from megatron.core import parallel_state

    found = {}
    for tp in (2, 1):
        parallel_state.initialize_model_parallel(tp, 1)
        cpu_compat.seed_model_parallel_rng(0)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        found[tp] = {"core": core_findings(tp, tp_rank), "model": model_findings(tp, tp_rank)}
        parallel_state.destroy_model_parallel()
    torch.save(found, f"{out}/rank{rank}.pt")
    collectives.destroy_process_group()
