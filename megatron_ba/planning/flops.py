"""Model FLOPs of a training step and model FLOPs utilisation (MFU), for comparison with peers.

    flops = training_flops(shape, [seq_len] * sequences)        # one optimiser step's model FLOPs
    mfu(flops, seconds, peak_tflops=PEAK_DENSE_BF16_TFLOPS["H200"])

Model FLOPs count what the model needs, not what a run spends: recomputation is not counted
(that would be hardware FLOPs), nor norms, activations, softmax or the optimiser. Per sequence of
S tokens, with N the parameters of the matrix multiplications, L layers, H query heads of
dimension d:

    training FLOPs = 6 N S  +  12 L H d P

* 6 N S: a matmul weight of n parameters costs 2n FLOPs per token forward and 4n backward (the
  input's and the weight's gradients). N = the layers' q, k, v, output and MLP projections plus
  the output layer (V x h; a tied output layer reuses the embedding, counted once here); the
  input embedding is a lookup and costs none.
* 12 L H d P: attention's two matmuls (q k^T and the weights times v) cost 2 d FLOPs per query
  head and (query, key) pair each, forward: 4 H d per pair and layer; training is 3 times the
  forward. P = the (query, key) pairs a causal mask keeps, S (S + 1) / 2. PaLM's convention
  (Chowdhery et al. 2022, appendix B: 6N + 12 L H Q T per token) counts all S^2 pairs:
  `attention="full"` gives that figure (about twice the causal one at long S).

MFU = model FLOPs / seconds / peak. The peak is the GPU's dense (no sparsity) bf16 tensor rate
from its vendor's data sheet; a run records which one it used.
"""

from __future__ import annotations

from megatron_ba.model_shape import ModelShape

# Dense bf16 tensor-core peaks (TFLOP/s) from NVIDIA's data sheets (the sparse figures are twice
# these). Keyed by a substring of torch.cuda.get_device_name().
PEAK_DENSE_BF16_TFLOPS = {"H200": 989.0}
PEAK_SOURCE = "NVIDIA H200 SXM data sheet: 1,979 TFLOP/s bf16 with sparsity, 989 dense"
ATTENTION_COUNTS = ("causal", "full")


def matmul_parameters(shape: ModelShape) -> int:
    """N: parameters of the step's matrix multiplications (projections and the output layer) of a
    dense decoder of full-attention layers; a mixture of experts (only the routed experts' share
    runs per token) or Gated DeltaNet layers (no S x S attention) are refused, not miscounted."""
    if shape.is_moe or shape.has_linear_attention:
        kind = "a mixture of experts" if shape.is_moe else "Gated DeltaNet layers"
        raise ValueError(
            f"shape: model FLOPs are counted for dense full-attention decoders, not {kind}"
        )
    h, d = shape.hidden_size, shape.head_dim
    q, kv = shape.num_attention_heads * d, shape.num_query_groups * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * shape.ffn_hidden_size
    return shape.num_layers * per_layer + shape.vocab_size * h


def attention_pairs(seq_len: int, attention: str = "causal") -> int:
    """(query, key) pairs of one sequence: S (S + 1) / 2 causal, S^2 full."""
    if attention not in ATTENTION_COUNTS:
        raise ValueError(f"attention: must be one of {ATTENTION_COUNTS}, got {attention!r}")
    if not (isinstance(seq_len, int) and seq_len >= 1):
        raise ValueError(f"seq_len: must be an integer >= 1, got {seq_len!r}")
    return seq_len * (seq_len + 1) // 2 if attention == "causal" else seq_len * seq_len


def training_flops(shape: ModelShape, seq_lens: list[int], attention: str = "causal") -> int:
    """Model FLOPs of a forward and backward over sequences of these lengths (module docstring)."""
    n = matmul_parameters(shape)
    per_pair = 12 * shape.num_layers * shape.num_attention_heads * shape.head_dim
    return sum(6 * n * s + per_pair * attention_pairs(s, attention) for s in seq_lens)


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named `device_name`, or None when it is not in the table."""
    for key, tflops in PEAK_DENSE_BF16_TFLOPS.items():
        if key in device_name:
            return tflops
    return None


def mfu(flops: float, seconds: float, peak: float) -> float:
    """Model FLOPs utilisation: flops / seconds over `peak` TFLOP/s."""
    if seconds <= 0 or peak <= 0:
        raise ValueError(f"seconds and peak: must be > 0, got {seconds} and {peak}")
    return flops / seconds / (peak * 1e12)
