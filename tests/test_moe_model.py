"""A Hugging Face Qwen3-MoE converted to a megatron-core GPTModel gives transformers' logits.

    python -m pytest tests/test_moe_model.py      # one spawned process (~1 min on 2 busy cores)

Two tiny random `Qwen3MoeForCausalLM` checkpoints saved by transformers (8 experts, top-2):
"renorm" (`norm_topk_prob=True`, every layer sparse, as the released Qwen3-MoE models) and
"plain" (`norm_topk_prob=False`, layer 1 dense through `mlp_only_layers`). Each is loaded into
megatron-core (local spec, SequentialMLP experts, allgather dispatcher, the CPU shims of
cpu_compat) in float64 and float32 and run on the same 24 tokens as transformers in that dtype:

- logits agree to AGREE32 in float32 (measured 5.4e-7 renorm, 3.9e-7 plain; logits ~0.1-1)
  and to AGREE64 in float64 (measured 8.5e-8, 1.6e-7): not ~1e-16, because both sides keep
  parts in float32 whatever the model's dtype: the router's softmax (HF
  `softmax(..., dtype=torch.float)`, megatron-core 0.16.1 moe_utils.py:711/715
  `dtype=torch.float32`) and the rotary frequencies (float32 `arange` in both);
- float32 negative controls, each seen to disagree by more than DISAGREE (measured >= 2.7e-2):
  experts 0 and 1 of layer 0
  swapped at load; the router's softmax order flipped (megatron's `moe_router_pre_softmax`
  opposite to what `norm_topk_prob` maps to), which shows the mapping is the one HF needs;
- the alltoall dispatcher (its `torch.cuda.Stream` shimmed) gives the allgather logits exactly;
- a backward through the model with the router's auxiliary loss reaches the router and every
  expert that was routed to (CPU, no CUDA call).
"""

from __future__ import annotations

import pytest
import torch

from tests.one_process import measure_in_one_process

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.stack]

AGREE64 = 1e-6
AGREE32 = 1e-5
DISAGREE = 1e-3
VARIANTS = {
    "renorm": dict(norm_topk_prob=True),
    "plain": dict(norm_topk_prob=False, mlp_only_layers=[1]),
}
DTYPES = {"float64": torch.float64, "float32": torch.float32}


def build_variant(root, name: str):
    """A tiny Qwen3-MoE of one variant, saved by transformers (float32 files)."""
    from megatron_ba.testing.tiny_hf import build_tiny_qwen3_moe

    return build_tiny_qwen3_moe(root / name, seed=3, **VARIANTS[name])


def hf_logits(model_dir, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    # "eager": the per-expert loop of modeling_qwen3_moe (the default grouped_mm takes no float64)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, experts_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(ids).logits


def megatron_logits(chunks, ids: torch.Tensor) -> torch.Tensor:
    """The model's full-vocabulary logits (TP=1) with the explicit causal mask of CPU runs."""
    from megatron_ba.megatron.batching import causal_mask

    s = ids.shape[1]
    with torch.no_grad():
        return chunks[0](ids, torch.arange(s)[None], causal_mask(s))


def _swapped_experts(spec, model_dir):
    """The real per-tensor read with experts 0 and 1 of layer 0 exchanged (a control)."""
    from megatron_ba.conversion import family_table, table_for
    from megatron_ba.conversion.hf_folder import HFCheckpoint

    table, ckpt = table_for(spec), HFCheckpoint(model_dir)
    swap = {"local_experts.0.": "local_experts.1.", "local_experts.1.": "local_experts.0."}

    def read(name: str) -> torch.Tensor:
        if name.startswith("decoder.layers.0."):
            for a, b in swap.items():
                if a in name:
                    name = name.replace(a, b)
                    break
        return family_table.megatron_tensor(table, spec, name, ckpt.get)

    return read


def _max_abs(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def _check_dtype(model_dir, dtype, ids) -> dict:
    from megatron_ba.conversion import load_hf_into_chunks, spec_from_hf_dir
    from megatron_ba.megatron import model as mm
    from megatron_ba.parallel import full_shape

    ref = hf_logits(model_dir, ids, dtype)
    spec = spec_from_hf_dir(model_dir, params_dtype=dtype)

    def run(spec, read=None, **overrides) -> torch.Tensor:
        config = mm.transformer_config(spec, perform_initialization=False, **overrides)
        chunks = mm.build_model_chunks(spec, ddp=False, config=config)
        if read is None:
            load_hf_into_chunks(chunks, model_dir, spec)
        else:
            full_shape.load_full_tensors(chunks, read)
        return megatron_logits(chunks, ids)

    got = run(spec)
    if dtype == torch.float64:
        return {"vs_hf": _max_abs(got, ref)}
    flipped = {"moe_router_pre_softmax": spec.moe_norm_topk_prob}
    return {
        "vs_hf": _max_abs(got, ref),
        "experts_swapped_vs_hf": _max_abs(run(spec, _swapped_experts(spec, model_dir)), ref),
        "pre_softmax_flipped_vs_hf": _max_abs(run(spec, **flipped), ref),
        "alltoall_vs_allgather": _max_abs(run(spec, moe_token_dispatcher_type="alltoall"), got),
    }


def _backward_reaches_router(model_dir) -> dict:
    from megatron_ba.conversion import load_hf_into_chunks, spec_from_hf_dir
    from megatron_ba.megatron import model as mm
    from megatron_ba.megatron.batching import causal_mask

    spec = spec_from_hf_dir(model_dir, moe_aux_loss_coeff=0.01)
    chunks = mm.build_model_chunks(spec, ddp=False)
    load_hf_into_chunks(chunks, model_dir, spec)
    ids = torch.arange(40)[None] % spec.vocab_size
    chunks[0](ids, torch.arange(40)[None], causal_mask(40)).float().pow(2).mean().backward()
    grads = {n: p.grad for n, p in chunks[0].named_parameters()}
    experts = [n for n in grads if ".local_experts." in n and n.startswith("decoder.layers.0.")]
    reached = [n for n in experts if grads[n] is not None and bool(grads[n].abs().sum() > 0)]
    return {
        "router_grad_norm": float(grads["decoder.layers.0.mlp.router.weight"].norm()),
        "experts_with_grad": len(reached),
        "expert_params": len(experts),
    }


def compute(dirs: dict) -> dict:
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(7))
    result = {
        f"{v}-{d}": _check_dtype(path, dtype, ids)
        for v, path in dirs.items()
        for d, dtype in DTYPES.items()
    }
    result["backward"] = _backward_reaches_router(dirs["renorm"])
    return result


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    dirs = {v: str(build_variant(root, v)) for v in VARIANTS}
    return measure_in_one_process(compute, dirs, out=root / "result.json")


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_megatron_logits_equal_transformers(measured, variant, dtype):
    r = measured[f"{variant}-{dtype}"]
    assert r["vs_hf"] < (AGREE64 if dtype == "float64" else AGREE32), r
    if dtype == "float64":
        return  # the controls run in float32
    # The controls: a wrong expert order or the other softmax order is a different model.
    assert r["experts_swapped_vs_hf"] > DISAGREE, r
    assert r["pre_softmax_flipped_vs_hf"] > DISAGREE, r


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_alltoall_dispatcher_equals_allgather(measured, variant):
    assert measured[f"{variant}-float32"]["alltoall_vs_allgather"] == 0.0


def test_backward_with_aux_loss_reaches_router_and_experts(measured):
    b = measured["backward"]
    assert b["router_grad_norm"] > 0
    # 40 tokens, top-2 of 8 experts: every expert of layer 0 is routed to at least once.
    assert b["experts_with_grad"] == b["expert_params"] == 16, b
