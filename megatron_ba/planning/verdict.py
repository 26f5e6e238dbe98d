"""Does a given layout fit, and if not, what single change would make it fit.

    v = assess(shape, layout, step, gpu_mem_gib=79.11, vllm=VLLMShare(0.6), seq_len=10240)
    v.fits, v.estimate.total_gib, v.reason
    gpu_memory_gib("H100")        # 79.11: what torch reports as the GPU's total capacity
    remedies(shape, layout, step, gpu_mem_gib=79.11, vllm=..., seq_len=..., gpus_per_node=8)
    # -> [("--recompute full", "parallel.recompute=full", 61.2), ...]

The verdict is the one rule of "fits": what `megatron-ba layout --json` reports as "fits" and
its exit status says (its search asks this function of every micro-batch it tries), what the
public-record test (tests/test_public_record.py) checks against runs that ran or went out of
memory, and what the Slurm launcher's fit check (planning/launch.py) applies before it submits
anything. A layout fits when all three hold: the tensors' peak within (1 - headroom) of the GPU
(the headroom stands for what the estimate leaves out and its error; HEADROOM, the CLI's
default), the whole estimate, overheads included (planning/memory.py), within the GPU's memory,
and a colocated engine's pool (vLLM's gpu_memory_utilization, SGLang's mem_fraction_static of
the GPU), after its weights, holding one sequence's KV cache (and, for a model with Gated
DeltaNet layers, their fixed per-sequence states).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_ba.model_shape import ModelShape
from megatron_ba.parallel.parallel_layout import LayoutError, ParallelLayout, balanced_stages
from megatron_ba.planning.generation_memory import (
    engine_tp,
    engine_weights_bytes,
    sequence_cache_bytes,
)
from megatron_ba.planning.memory import GIB, EngineShare, MemoryEstimate, MemorySettings, estimate

# gpu_memory_gib("H100")        # 79.11: what torch reports as the GPU's total capacity
#     overhead_bytes(peak_bytes)    # CUDA context, NCCL buffers, allocator fragmentation
#     verdict(est, gpu_mem_gib=79.11)
#
# The capacities are the "total capacity" torch's out-of-memory message prints for each part (its
# 80 GB, 141 GB, 96 GB are GB of 10^9 bytes, less what the driver keeps):
# * H100 80 GB: 79.11 GiB (https://github.com/THUDM/slime/issues/1767)
# * H200: 139.81 GiB (https://github.com/THUDM/slime/issues/1951)
# * H20: 95.08 GiB (https://github.com/verl-project/verl/issues/5840)
# * A100 / A800 80 GB: 79.15 GiB (vLLM's and PyTorch users' messages for the 80 GB part)
# * H800 80 GB: the H100 SXM's 80 GB of HBM3 at 3.35 TB/s (NVIDIA's H800 datasheet gives the
#   H100's memory), so the H100's 79.11 GiB; no H800 out-of-memory message was found
# * GB200: 184 GiB, the total SGLang reports on a real GB200 ("0.75 x 184 GB = 138 GB" of
#   --mem-fraction-static, SGLang's "GB" being GiB: https://github.com/sgl-project/sglang/pull/
#   31900); NVIDIA gives 186 GB per GPU (13.4 TB of HBM3e per 72-GPU NVL72); no torch
#   out-of-memory message of a GB200 was found
# * B200: 178.35 GiB ("GPU 0 has a total capacity of 178.35 GiB", torch on a B200 that NVIDIA
#   sells as 180 GB: stas00/ml-engineering debug/pytorch.md @744d01e, the same figure in
#   https://github.com/pytorch/ao/pull/4002's device query)
# * GB300: 276.50 GiB ("GPU 0 has a total capacity of 276.50 GiB", torch on a GB300 of a DGX
#   Station: stas00/ml-engineering debug/pytorch.md @744d01e); NVIDIA's Megatron-Bridge gives
#   279 GB for it beside 180 for the B200 (src/megatron/bridge/perf_recipes/qwen/b200/
#   qwen3_moe.py @9c0cd25), the same 1.7-point gap as the B200's to torch's; no torch message
#   of an NVL72 GB300 was found
# * B300: 267.69 GiB ("GPU 0 has a total capacity of 267.69 GiB" in torch's out-of-memory
#   messages of two public Megatron run reports on 8 x B300 nodes, 2026-08; the search index that
#   found them does not name their repositories); nvidia-smi gives the "NVIDIA B300 SXM6 AC"
#   275040 MiB (268.59 GiB: simone-chen/aiconfigurator src/aiconfigurator/systems/
#   b300_sxm.yaml @84ba899), torch's figure below it as the H100's 79.11 is below its 79.65
# * L20 48 GB: 44.53 GiB ("GPU 0 has a total capacity of 44.53 GiB", torch on an 8 x L20
#   machine: https://github.com/Tencent-Hunyuan/HunyuanCustom/issues/36); nvidia-smi gives the
#   "NVIDIA L20" 46068 MiB
GPU_MEMORY_GIB = {
    "H100": 79.11,
    "H200": 139.81,
    "H20": 95.08,
    "A100": 79.15,
    "A800": 79.15,
    "H800": 79.11,
    "GB200": 184.0,
    "B200": 178.35,
    "GB300": 276.5,
    "B300": 267.69,
    "L20": 44.53,
}

HEADROOM = 0.1  # the fraction of the GPU the tensors' peak must leave free (module docstring)


def check_headroom(headroom: float) -> float:
    """`headroom` when it is a fraction in [0, 1), else ValueError naming --headroom."""
    if not 0 <= headroom < 1:
        raise ValueError(f"--headroom: must be in [0, 1), got {headroom}")
    return headroom


def gpu_memory_gib(name: str) -> float:
    """The capacity of a GPU named in GPU_MEMORY_GIB (case-insensitive); ValueError otherwise."""
    for key, gib in GPU_MEMORY_GIB.items():
        if key.lower() == name.strip().lower():
            return gib
    raise ValueError(f"--gpu {name}: one of {', '.join(GPU_MEMORY_GIB)}, or give --gpu-mem GIB")


@dataclass
class Verdict:
    fits: bool
    estimate: MemoryEstimate
    reason: str  # why not, in words: each part of the rule that failed ("" when it fits)


def assess(
    shape: ModelShape,
    layout: ParallelLayout,
    step: MemorySettings,
    *,
    gpu_mem_gib: float,
    vllm: EngineShare | None,
    seq_len: int,
    headroom: float = HEADROOM,
) -> Verdict:
    """The verdict on one layout and its step's settings (module docstring); the reason names
    every part that failed, after what the layout needs per GPU."""
    e = estimate(shape, layout, step, gpu_mem_gib=gpu_mem_gib, vllm=vllm, seq_len=seq_len)
    gpu = gpu_mem_gib * GIB
    failed = []
    if e.total > gpu:
        failed.append("more than the GPU holds")
    if e.peak > (1 - headroom) * gpu:
        failed.append(
            f"its tensors' peak, {e.peak_gib:.1f} GiB, is over the "
            f"{(1 - headroom) * gpu_mem_gib:.1f} GiB the headroom of {headroom:g} leaves"
        )
    if vllm is not None:
        # one sequence: its full-attention layers' keys and values and, for a Qwen3.5 model,
        # its Gated DeltaNet layers' fixed states (generation_memory.sequence_cache_bytes)
        need = sequence_cache_bytes(shape, engine_tp(vllm, layout), seq_len)
        if e.vllm_kv_cache < need:
            weights = engine_weights_bytes(shape, engine_tp(vllm, layout)) / GIB
            failed.append(
                f"{vllm.name}'s {vllm.gpu_util:g} of the GPU, after its {weights:.1f} GiB of "
                f"weights, cannot hold one sequence's KV cache ({need / GIB:.2f} GiB)"
            )
    if not failed:
        return Verdict(True, e, "")
    needs = (
        f"needs {e.total_gib:.1f} GiB per GPU ({e.peak_phase} phase, stage {e.worst_stage}) of "
        f"{gpu_mem_gib:g} GiB"
    )
    return Verdict(False, e, f"{needs}: {', and '.join(failed)}")


def _changes(shape: ModelShape, layout: ParallelLayout, step: MemorySettings, gpus_per_node: int):
    """(flag, recipe key, changed layout, changed step) for each single change that lowers
    memory; a layout change its rules refuse (e.g. expert parallelism that no longer divides
    the new tp x cp x dp, more stages than layers) is not offered. Doubling pp re-splits the
    layers as evenly as megatron-core allows (balanced_stages), whatever split the layout had."""
    lo = layout
    if step.recompute_mode != "full":
        yield "--recompute full", "parallel.recompute=full", lo, replace(step, recompute="full")
    for name in ("cp", "tp", "pp"):
        value = getattr(lo, name)
        if lo.dp % 2 == 0 and (name != "tp" or 2 * value <= gpus_per_node):
            changed = {name: 2 * value, "dp": lo.dp // 2}
            if name == "tp":
                changed["sequence_parallel"] = True  # the planner's layouts: SP with tp > 1
            keys = [f"parallel.{name}={2 * value}"]
            try:
                if name == "pp":
                    split = balanced_stages(shape.num_layers, 2 * value)
                    changed |= {"pp_first_stage_layers": None, "pp_last_stage_layers": None}
                    changed |= split
                    keys += [f"parallel.{k}={v}" for k, v in split.items()]
                new = replace(lo, **changed)
            except LayoutError:
                continue
            yield f"--{name} {2 * value}", " ".join(keys), new, step
    if step.micro_batch_tokens > 1:
        half = replace(step, micro_batch_tokens=step.micro_batch_tokens // 2)
        yield "half the micro-batch", "parallel.micro_batch_size (halved)", lo, half


def remedies(
    shape: ModelShape,
    layout: ParallelLayout,
    step: MemorySettings,
    *,
    gpu_mem_gib: float,
    vllm: EngineShare | None,
    seq_len: int,
    gpus_per_node: int,
    headroom: float = HEADROOM,
) -> list[tuple[str, str, float]]:
    """The single changes under which the layout fits (assess's verdict, at `headroom`): (flag,
    recipe key(s), GiB per GPU), in the order tried: full recompute, CP x2, TP x2, PP x2 (each
    taken from DP; PP's layers split as evenly as megatron-core allows), half the micro-batch
    (while it still holds a whole sequence), then the smallest colocated vLLM engine TP (a
    power of two within the node) whose share holds its weights and one sequence's KV cache."""
    tries = [
        (flag, key, new, new_step, vllm)
        for flag, key, new, new_step in _changes(shape, layout, step, gpus_per_node)
    ]
    if vllm is not None:
        tp = 2 * engine_tp(vllm, layout)
        while tp <= gpus_per_node:
            new_vllm = replace(vllm, tp=tp)
            tries.append(
                (f"{vllm.name} TP {tp}", f"rollout.engine_tp={tp}", layout, step, new_vllm)
            )
            tp *= 2
    out = []
    for flag, key, new, new_step, new_vllm in tries:
        if new_step.micro_batch_tokens < seq_len:
            continue
        try:
            v = assess(shape, new, new_step, gpu_mem_gib=gpu_mem_gib, vllm=new_vllm,
                       seq_len=seq_len, headroom=headroom)  # fmt: skip
        except ValueError:
            continue  # e.g. the new tp no longer divides the model's heads
        if v.fits:
            out.append((flag, key, round(v.estimate.total_gib, 1)))
            if new_vllm is not vllm:
                break  # the smallest engine TP that fits
    return out
