"""GPUs by name, the memory a run needs beyond its tensors, and the fits / OOM verdict.

    gpu_memory_gib("H100")        # 79.11: what torch reports as the GPU's total capacity
    overhead_bytes(peak_bytes)    # CUDA context, NCCL buffers, allocator fragmentation
    verdict(est, gpu_mem_gib=79.11)

The capacities are the "total capacity" torch's out-of-memory message prints for each part (its
80 GB, 141 GB, 96 GB are GB of 10^9 bytes, less what the driver keeps):
* H100 80 GB: 79.11 GiB (https://github.com/THUDM/slime/issues/1767)
* H200: 139.81 GiB (https://github.com/THUDM/slime/issues/1951)
* H20: 95.08 GiB (https://github.com/verl-project/verl/issues/5840)
* A100 / A800 80 GB: 79.15 GiB (vLLM's and PyTorch users' messages for the 80 GB part)

The overhead terms are physical, the same for every run (never fitted to one case), read off
two out-of-memory messages of megatron-core trainer processes that print the split:
* memory outside PyTorch's allocator (CUDA context, NCCL's communicator buffers, cuBLAS / TE
  workspaces): NON_TORCH_GIB per process, the mean of the two. slime issues/1767 above (H100):
  48.84 GiB in use by the trainer, 44.61 allocated by PyTorch, 0.40 reserved and unallocated:
  3.83 GiB outside; slime issues/1951 above (H200): 88.83 in use, 82.55 allocated, 2.06
  reserved: 4.22 GiB outside.
* the caching allocator's reserved-but-unallocated memory: FRAGMENTATION of what PyTorch holds
  (the same messages: 0.40 of 45.0 GiB, 2.06 of 84.6 GiB; the larger, 2.4 %, rounded up).
"""

from __future__ import annotations

GIB = 1024**3

GPU_MEMORY_GIB = {"H100": 79.11, "H200": 139.81, "H20": 95.08, "A100": 79.15, "A800": 79.15}

NON_TORCH_GIB = (3.83 + 4.22) / 2
FRAGMENTATION = 0.025


def gpu_memory_gib(name: str) -> float:
    """The capacity of a GPU named in GPU_MEMORY_GIB (case-insensitive); ValueError otherwise."""
    for key, gib in GPU_MEMORY_GIB.items():
        if key.lower() == name.strip().lower():
            return gib
    raise ValueError(f"--gpu {name}: one of {', '.join(GPU_MEMORY_GIB)}, or give --gpu-mem GIB")


def overhead_bytes(torch_bytes: float) -> float:
    """NON_TORCH_GIB + FRAGMENTATION of the `torch_bytes` PyTorch's allocator holds."""
    return NON_TORCH_GIB * GIB + FRAGMENTATION * torch_bytes
