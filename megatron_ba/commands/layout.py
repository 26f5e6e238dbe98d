"""`megatron-ba layout`: a TP/PP/CP/DP layout, micro-batch size and per-GPU memory estimate.

    megatron-ba layout --model Qwen2.5-Math-7B --nodes 4 --gpus-per-node 8 --gpu-mem 80 \\
        --max-response-len 3584 --group-size 16 --prompts-per-step 32
    megatron-ba layout --model-config path/to/config.json --nodes 2 --gpus-per-node 8 \\
        --gpu H100 --seq-len 10240 --tp 4 --pp 2 --ep 8 --recompute full --json

Models: the presets of megatron_ba.model_shape.PRESETS (dense, MoE, Qwen3.5), or any HF config.json
(or a folder holding one) through --model or --model-config. RoPE scaling (YaRN, from the
config.json or --yarn FACTOR,ORIGINAL) changes no memory term, only the context: a sequence longer
than factor x original is refused (without scaling no context is checked: the presets'
max_position_embeddings are not the models'). The estimate's terms and
assumptions: megatron_ba/planning/memory.py; its verdicts against public runs that ran or went
out of memory: docs/cluster-planning.md. Exit status: 0 a layout fits, 1 none does (with
--json the closest is printed, "fits" false), 2 a bad option; "fits" is exactly what the exit
status says (planning.verdict.assess at --headroom: the tensors' peak, the whole estimate, the
colocated engine's KV cache). A forward-only log-prob pass in micro-batches of its own
(--logprob-batch-size, NeMo-RL's) is a third phase (planning/logprob_memory.py). The engine
(--engine vllm|sglang, each with its memory key), its process and its refit, and the
gradients' dtype (--grad-reduce) are the generation and training phases' settings
(planning/generation_memory.py, planning/memory.py). A --pp that does not divide the layers
splits them as evenly as megatron-core allows, unless --pp-first-stage-layers /
--pp-last-stage-layers give the split.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from megatron_ba.commands.layout_args import add_arguments, parse_offload
from megatron_ba.commands.layout_text import render
from megatron_ba.parallel.parallel_layout import UNEVEN
from megatron_ba.planning.cluster_layout import NoLayoutFits, Settings, propose
from megatron_ba.planning.memory import EngineShare, load_model
from megatron_ba.planning.verdict import gpu_memory_gib
from megatron_ba.recipe import VLLM_GPU_MEMORY_UTILIZATION
from megatron_ba.rope_scaling import RopeScaling

__all__ = ["add_arguments", "run"]  # what megatron_ba.cli registers


def _check(args: argparse.Namespace) -> None:
    """ValueError naming the flag for what argparse cannot check."""
    for flag, value in (
        ("--group-size", args.group_size),
        ("--prompts-per-step", args.prompts_per_step),
        ("--ep", args.ep),
        ("--etp", args.etp),
        ("--micro-batch-size", args.micro_batch_size),
        ("--max-tokens-per-gpu", args.max_tokens_per_gpu),
        ("--seq-len", args.seq_len),
        ("--vllm-tp", args.vllm_tp),
        ("--logprob-batch-size", args.logprob_batch_size),
        ("--pp-first-stage-layers", args.pp_first_stage_layers),
        ("--pp-last-stage-layers", args.pp_last_stage_layers),
        ("--vp", args.vp),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag}: must be >= 1, got {value}")
    if args.vp > 1 and (args.pp is None or args.pp < 2):
        raise ValueError(f"--vp: {args.vp} interleaves pipeline stages: pin --pp 2 or more")
    _check_engine(args)
    if (args.model is None) == (args.model_config is None):
        raise ValueError("--model or --model-config: give exactly one")
    if (args.gpu is None) == (args.gpu_mem is None):
        raise ValueError("--gpu or --gpu-mem: give exactly one")
    if (args.seq_len is None) == (args.max_response_len is None):
        raise ValueError("--seq-len or --max-response-len: give exactly one")


def _check_engine(args: argparse.Namespace) -> None:
    """ValueError naming the flag for an engine key that does not fit --engine."""
    if args.engine == "sglang":
        if args.vllm_gpu_util is not None:
            raise ValueError("--vllm-gpu-util: vLLM's key; --engine sglang takes "
                             "--sglang-mem-fraction")  # fmt: skip
        if args.sglang_mem_fraction is None:
            raise ValueError("--sglang-mem-fraction: required with --engine sglang (its "
                             "mem_fraction_static)")  # fmt: skip
    elif args.sglang_mem_fraction is not None:
        raise ValueError("--sglang-mem-fraction: SGLang's key; give --engine sglang")
    for flag, value in (
        ("--vllm-gpu-util", args.vllm_gpu_util),
        ("--sglang-mem-fraction", args.sglang_mem_fraction),
    ):
        if value is not None and not 0 <= value < 1:
            raise ValueError(f"{flag}: must be in [0, 1), got {value}")
    if not args.refit_bucket_mb >= 0:
        raise ValueError(f"--refit-bucket-mb: must be >= 0, got {args.refit_bucket_mb}")


def engine_share(args: argparse.Namespace) -> EngineShare | None:
    """The colocated engine of the parsed options (None: a share of 0, no engine here)."""
    share = args.sglang_mem_fraction if args.engine == "sglang" else args.vllm_gpu_util
    if share is None:
        share = VLLM_GPU_MEMORY_UTILIZATION
    if not share:
        return None
    return EngineShare(
        share,
        sleeps=not args.vllm_awake,
        tp=args.vllm_tp,
        engine=args.engine,
        in_process=args.engine_in_process,
        refit_bucket_mb=args.refit_bucket_mb,
        refit_before_kv=args.refit_before_kv,
    )


def run(args: argparse.Namespace) -> int:
    try:
        _check(args)
        offload, cpu_adam = parse_offload(args.offload)
        gpu_mem = args.gpu_mem if args.gpu_mem is not None else gpu_memory_gib(args.gpu)
        shape = _with_yarn(load_model(args.model or args.model_config), args)
    except ValueError as e:
        print(f"layout: {e}", file=sys.stderr)
        return 2
    vllm = engine_share(args)
    settings = Settings(
        recompute=args.recompute,
        micro_batch_size=args.micro_batch_size,
        max_tokens_per_gpu=args.max_tokens_per_gpu,
        offload=offload,
        cpu_adam=cpu_adam,
        distributed_optimizer=not args.no_distributed_optimizer,
        logprobs=args.logprobs,
        reference=args.reference,
        prefer=args.prefer,
        grad_reduce=args.grad_reduce,
        optimizer_states=args.optimizer_states,
        logprob_batch_size=args.logprob_batch_size,
        virtual_pipeline=args.vp,
    )
    try:
        plan = propose(
            shape,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            gpu_mem_gib=gpu_mem,
            max_response_len=args.max_response_len or args.seq_len,
            prompt_len=args.prompt_len if args.seq_len is None else 0,
            seq_len=args.seq_len,
            group_size=args.group_size,
            prompts_per_step=args.prompts_per_step,
            vllm=vllm,
            headroom=args.headroom,
            only={
                **{k: getattr(args, k) for k in ("tp", "pp", "cp", "ep", "etp", *UNEVEN)},
                "sequence_parallel": False if args.no_sequence_parallel else None,
            },
            settings=settings,
        )
    except NoLayoutFits as e:
        print(f"layout: {e}", file=sys.stderr)
        if args.json and e.closest is not None:
            print(json.dumps(e.closest.to_json(), indent=2))
        return 1
    except ValueError as e:
        print(f"layout: {e}", file=sys.stderr)
        return 2
    j = plan.to_json()
    j["max_context"] = shape.max_context if shape.rope_scaling is not None else None
    j["rope_scaling"] = None if shape.rope_scaling is None else shape.rope_scaling.hf_fields()
    print(json.dumps(j, indent=2) if args.json else render(j))
    return 0


def _with_yarn(shape, args: argparse.Namespace):
    """`shape` with --yarn's scaling; ValueError when the sequence outgrows a scaled context."""
    if args.yarn is not None:
        try:
            factor, original = args.yarn.split(",")
            scaling = RopeScaling(float(factor), int(original))
        except ValueError as e:
            raise ValueError(f"--yarn {args.yarn}: FACTOR,ORIGINAL such as 2,32768 ({e})") from None
        shape = dataclasses.replace(shape, rope_scaling=scaling)
    if shape.rope_scaling is None:
        return shape
    seq = args.seq_len or args.prompt_len + args.max_response_len
    s = shape.rope_scaling
    if seq > shape.max_context:
        flag = "--seq-len" if args.seq_len else "--max-response-len + --prompt-len"
        raise ValueError(
            f"{flag}: {seq} tokens exceed the model's context {shape.max_context} (YaRN factor "
            f"{s.factor:g} x original_max_position_embeddings {s.original_max_position_embeddings})"
        )
    return shape
