"""GPUs by name, the memory a run needs beyond its tensors, and the fits / OOM verdict.

    gpu_memory_gib("H100")        # 79.11: what torch reports as the GPU's total capacity
    overhead_bytes(est)           # CUDA context, NCCL buffers, allocator fragmentation
    verdict(est, gpu_mem_gib=79.11)

The capacities are the "total capacity" torch's out-of-memory message prints for each part (its
80 GB, 141 GB, 96 GB are GB of 10^9 bytes, less what the driver keeps): H100 80 GB 79.11 GiB
(THUDM/slime issue 1767), H200 139.81 GiB (THUDM/slime issue 1951), H20 95.08 GiB
(verl-project/verl issue 5840), A100 / A800 80 GB 79.15 GiB (vLLM's and PyTorch users'
messages for the 80 GB part).

The overhead terms are physical, the same for every run (never fitted to one case):
* CUDA context and library workspaces (cuBLAS, cuDNN, flash attention): CONTEXT_GIB per process;
* NCCL's communicator buffers: NCCL_GIB_PER_GROUP for each parallel group of more than one rank
  (data, tensor, pipeline, context, expert), NCCL's default of a few MiB per channel and peer;
* the caching allocator's fragmentation: FRAGMENTATION of the memory that changes shape from
  micro-batch to micro-batch (activations and logits), which the allocator cannot always reuse.
"""

from __future__ import annotations

GIB = 1024**3

GPU_MEMORY_GIB = {"H100": 79.11, "H200": 139.81, "H20": 95.08, "A100": 79.15, "A800": 79.15}

CONTEXT_GIB = 1.0
NCCL_GIB_PER_GROUP = 0.25
FRAGMENTATION = 0.10


def gpu_memory_gib(name: str) -> float:
    """The capacity of a GPU named in GPU_MEMORY_GIB (case-insensitive); ValueError otherwise."""
    for key, gib in GPU_MEMORY_GIB.items():
        if key.lower() == name.strip().lower():
            return gib
    raise ValueError(f"--gpu {name}: one of {', '.join(GPU_MEMORY_GIB)}, or give --gpu-mem GIB")


def parallel_groups(tp: int, pp: int, cp: int, dp: int, ep: int = 1) -> int:
    """How many of the data, tensor, pipeline, context and expert groups have > 1 rank."""
    return sum(size > 1 for size in (dp, tp, pp, cp, ep))


def overhead_bytes(dynamic_bytes: float, groups: int) -> float:
    """CONTEXT_GIB + NCCL_GIB_PER_GROUP per group + FRAGMENTATION of `dynamic_bytes`."""
    return (CONTEXT_GIB + NCCL_GIB_PER_GROUP * groups) * GIB + FRAGMENTATION * dynamic_bytes
