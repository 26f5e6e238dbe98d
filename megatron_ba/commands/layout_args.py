"""`megatron-ba layout`'s options (add_arguments) and the parse of --offload: what each flag
means, in one place; megatron_ba.commands.layout checks and runs them."""

from __future__ import annotations

import argparse

from megatron_ba.planning.cluster_layout import PREFER
from megatron_ba.planning.generation_memory import ENGINES, REFIT_BUCKET_MB
from megatron_ba.planning.memory import GRAD_BYTES, LOGPROBS, OPTIMIZER_STATE_BYTES, RECOMPUTE
from megatron_ba.planning.verdict import GPU_MEMORY_GIB, HEADROOM
from megatron_ba.recipe import VLLM_GPU_MEMORY_UTILIZATION


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="preset name or HF config.json (or its folder)")
    p.add_argument("--model-config", metavar="PATH", help="an HF config.json (dense or MoE)")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--gpu-mem", type=float, metavar="GIB", help="GiB per GPU")
    p.add_argument("--gpu", help=f"GPU model, for its memory: {', '.join(GPU_MEMORY_GIB)}")
    p.add_argument("--max-response-len", type=int, help="tokens per response")
    p.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt (default 512)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (prompt + response; SFT)")
    p.add_argument(
        "--yarn",
        metavar="FACTOR,ORIGINAL",
        help=(
            "YaRN RoPE scaling, as config.json's rope_scaling would set it (e.g. 2,32768 for "
            "Qwen3 at 64K): memory is unchanged, the context becomes FACTOR x ORIGINAL"
        ),
    )
    p.add_argument("--group-size", type=int, help="responses per prompt (grpo.group_size)")
    p.add_argument("--prompts-per-step", type=int, help="prompts per step (grpo.prompts_per_step)")
    _engine_arguments(p)
    p.add_argument(
        "--headroom",
        type=float,
        default=HEADROOM,
        help=(
            f"fraction of the GPU the tensors' peak must leave free, part of the verdict "
            f"(default {HEADROOM})"
        ),
    )
    _setting_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    """The colocated generation engine: which, its memory key, TP, sleep, process and refit."""
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default="vllm",
        help="the colocated generation engine (default vllm); its memory key is --vllm-gpu-util "
        "or --sglang-mem-fraction",
    )
    p.add_argument(
        "--vllm-gpu-util",
        type=float,
        help=(
            "vLLM's gpu_memory_utilization: its share of the GPU while it generates (weights, "
            "activation peak, KV cache; the recipe's rollout.gpu_memory_utilization; default "
            f"{VLLM_GPU_MEMORY_UTILIZATION}; 0: no engine on these GPUs: SFT or one elsewhere)"
        ),
    )
    p.add_argument(
        "--sglang-mem-fraction",
        type=float,
        metavar="F",
        help="with --engine sglang (required): SGLang's mem_fraction_static, the share of the GPU "
        "for its weights and KV cache pool (0: no engine on these GPUs)",
    )
    p.add_argument(
        "--vllm-tp",
        type=int,
        metavar="N",
        help="the colocated engine's tensor parallelism (rollout.engine_tp; default: --tp's)",
    )
    p.add_argument(
        "--vllm-awake",
        action="store_true",
        help="the engine keeps its memory while the policy trains (no sleep mode / offload)",
    )
    p.add_argument(
        "--engine-in-process",
        action="store_true",
        help="the engine runs in the trainer's process (verl's sync mode; rollout.in_process): no "
        "second process's CUDA context and communicators",
    )
    p.add_argument(
        "--refit-bucket-mb",
        type=float,
        default=REFIT_BUCKET_MB,
        metavar="MB",
        help=f"MiB of the refit's bucket (rollout.refit_bucket_mb; default {REFIT_BUCKET_MB}; 0: "
        "one tensor at a time)",
    )
    p.add_argument(
        "--refit-before-kv",
        action="store_true",
        help="the refit runs with only the engine's weights awake, before its KV cache (verl, "
        "NeMo-RL; default: the whole engine is awake, as this project's refit)",
    )


def _layout_arguments(p: argparse.ArgumentParser) -> None:
    """The layout's pins: tp, pp and its uneven stages, cp, expert parallelism, sequence
    parallelism."""
    for name in ("tp", "pp", "cp"):
        p.add_argument(f"--{name}", type=int, help=f"pin {name} (estimate a given layout)")
    for end in ("first", "last"):
        p.add_argument(
            f"--pp-{end}-stage-layers",
            type=int,
            metavar="N",
            help=(
                f"with --pp: the {end} pipeline stage's layers, the other stages an equal share "
                f"(parallel.pp_{end}_stage_layers; default: an even split, or, where --pp does "
                "not divide the layers, the most even split megatron-core allows)"
            ),
        )
    p.add_argument("--ep", type=int, help="pin expert parallelism (MoE; default 1)")
    p.add_argument(
        "--etp",
        type=int,
        help="pin expert tensor parallelism (MoE; default 1: whole experts on each GPU, as "
        "NeMo-RL's configs set it; megatron-core's own default, and a recipe's etp: null, is tp)",
    )
    p.add_argument(
        "--no-sequence-parallel",
        action="store_true",
        help="tp > 1 without sequence parallelism (parallel.sequence_parallel: false; the norms' "
        "activations are then whole on every TP rank; a mixture of experts refuses it)",
    )


def _setting_arguments(p: argparse.ArgumentParser) -> None:
    """The layout, recomputation, offload, batching and optimiser options."""
    _layout_arguments(p)
    p.add_argument(
        "--reference",
        action="store_true",
        help="a frozen reference policy's weights stay on the GPU (a recipe's loss.kl_coef > 0)",
    )
    p.add_argument(
        "--recompute", choices=RECOMPUTE, help="pin activation recomputation (default: searched)"
    )
    p.add_argument(
        "--offload",
        default="auto",
        metavar="MODE",
        help=(
            "none (weights, gradients, optimiser stay on the GPU while vLLM generates), states "
            "(all three leave it between phases: verl's offload), cpu-adam[=F] (megatron's "
            "hybrid CPU Adam keeps F of the optimiser on the CPU, default 1), or a comma list "
            "such as states,cpu-adam=1 (default auto: the weights stay while vLLM sleeps)"
        ),
    )
    batch = p.add_mutually_exclusive_group()
    batch.add_argument(
        "--micro-batch-size", type=int, metavar="M", help="sequences per micro-batch"
    )
    batch.add_argument(
        "--max-tokens-per-gpu",
        type=int,
        metavar="T",
        help="dynamic batching / packing: tokens per micro-batch on each GPU",
    )
    p.add_argument(
        "--logprobs",
        choices=LOGPROBS,
        default="chunked",
        help=(
            "the log-prob / loss path over the vocabulary: chunked (megatron-ba's, default), "
            "megatron (megatron-core's vocab-parallel cross entropy, fp32 softmax), fp32 "
            "(NeMo-RL's: the logits cast to fp32, then a vocab-parallel log-softmax), naive, "
            "te (Transformer Engine's fused cross entropy up to 2.17, megatron-core's "
            "cross_entropy_fusion_impl te: the gradient written into the bf16 logits), "
            "te-fp32-grad (the same from Transformer Engine 2.18: an fp32 gradient kept)"
        ),
    )
    p.add_argument(
        "--logprob-batch-size",
        type=int,
        metavar="N",
        help=(
            "sequences per micro-batch of a forward-only log-prob pass before training "
            "(NeMo-RL's policy.logprob_batch_size, whose default is its train_micro_batch_size): "
            "its logits over the vocabulary for N x the sequence's tokens at once, by --logprobs' "
            "path (default: none, this project's trainer has no such pass)"
        ),
    )
    p.add_argument(
        "--prefer",
        choices=PREFER,
        default="parallelism",
        help=(
            "how fitting layouts are ranked: parallelism (default: least model parallelism, "
            "then least recomputation) or compute (least recomputation first: full "
            "recomputation costs 4/3 of the compute)"
        ),
    )
    _optimizer_arguments(p)


def _optimizer_arguments(p: argparse.ArgumentParser) -> None:
    """The optimiser's sharding and the gradient buffer's dtype."""
    p.add_argument(
        "--no-distributed-optimizer",
        action="store_true",
        help="optimiser states replicated on every data-parallel rank",
    )
    p.add_argument(
        "--grad-reduce",
        choices=tuple(GRAD_BYTES),
        default="fp32",
        help="the gradient buffer's dtype: fp32 (megatron-core's grad_reduce_in_fp32, the "
        "mixed-precision recipe and this project's trainer; default) or bf16 (NeMo-RL's)",
    )
    p.add_argument(
        "--optimizer-states",
        choices=tuple(OPTIMIZER_STATE_BYTES),
        default="fp32",
        help="the Adam states' bytes per parameter: fp32 (an fp32 main copy and moments, 12; "
        "default), precision-aware (megatron-core's use_precision_aware_optimizer with fp32 "
        "states: the master's low 16 bits beside the bf16 weights, 10), bf16 (precision-aware "
        "with bf16 exp_avg / exp_avg_sq, 6)",
    )
    p.add_argument(
        "--vp",
        type=int,
        default=1,
        help="virtual pipeline stages per rank (megatron-core's interleaved 1F1B, "
        "virtual_pipeline_model_parallel_size; needs a pinned --pp > 1): the micro-batches it "
        "holds in flight; for other frameworks' runs, this project's trainer runs 1",
    )


def parse_offload(text: str) -> tuple[str, float]:
    """--offload's value -> (MemorySettings' offload mode, hybrid CPU Adam's fraction)."""
    mode, cpu_adam = "auto", 0.0
    for part in (x.strip() for x in text.split(",")):
        name, _, value = part.partition("=")
        if name in ("auto", "none", "states") and not value:
            mode = name
        elif name == "cpu-adam":
            try:
                cpu_adam = float(value) if value else 1.0
            except ValueError:
                raise ValueError(
                    f"--offload {text}: cpu-adam=F needs a number, got {value!r}"
                ) from None
            if not 0 < cpu_adam <= 1:
                raise ValueError(f"--offload {text}: cpu-adam=F: F must be in (0, 1]")
        else:
            raise ValueError(
                f"--offload {text}: each of none, states, cpu-adam[=F] (comma-separated)"
            )
    return mode, cpu_adam
