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

from megatron_ba.parallel.parallel_layout import UNEVEN
from megatron_ba.planning.cluster_layout import PREFER, NoLayoutFits, Settings, propose
from megatron_ba.planning.generation_memory import ENGINES, REFIT_BUCKET_MB
from megatron_ba.planning.memory import GRAD_BYTES, LOGPROBS, RECOMPUTE, EngineShare, load_model
from megatron_ba.planning.verdict import GPU_MEMORY_GIB, HEADROOM, gpu_memory_gib
from megatron_ba.recipe import VLLM_GPU_MEMORY_UTILIZATION
from megatron_ba.rope_scaling import RopeScaling


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
            "(NeMo-RL's: the logits cast to fp32, then a vocab-parallel log-softmax), naive"
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
    print(json.dumps(j, indent=2) if args.json else _text(j))
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


def _text(j: dict) -> str:
    b = j["breakdown_gib"]
    lines = [
        f"{j['model']} ({j['params_billion']} B parameters) on {j['nodes']} x {j['gpus_per_node']}"
        f" GPUs of {j['gpu_mem_gib']} GiB, {j['seq_len']} tokens per sequence:",
        f"  layout: tp={j['tp']} pp={j['pp']}{_split(j)} cp={j['cp']} dp={j['dp']} ep={j['ep']}"
        f"{'' if j['etp'] is None else ' etp=' + str(j['etp'])}, micro-batch "
        f"{j['micro_batch_size']} sequence(s) = {j['micro_batch_tokens']} tokens "
        f"({j['micro_batch_tokens_per_gpu']} per GPU), recompute={j['recompute_mode']}",
        f"  per GPU (worst pipeline stage {j['worst_stage']}, {j['peak_phase']} phase): "
        f"{j['memory_gib_per_gpu']} GiB, fits={j['fits']} (headroom {j['headroom']:g})",
        f"    weights {b['weights']}  gradients ({j['grad_reduce']}) {b['grads']}  optimizer "
        f"({'distributed' if j['distributed_optimizer'] else 'replicated'}) {b['optimizer']}",
        f"    activations {b['activations']} (no recompute {b['activations_no_recompute']}, "
        f"full recompute {b['activations_full_recompute']}; {_in_flight(j)})",
        f"    logits {b['logits']} (naive {b['logits_naive']}, chunked {b['logits_chunked']})",
        *_logprob_lines(j),
        *_engine_lines(j),
        f"    CUDA context, NCCL buffers, fragmentation, engine process {b['overhead']} "
        f"(engine process {b['engine_process']})",
        "  recipe overrides: " + " ".join(j["overrides"]),
    ]
    r = j["rope_scaling"]
    if r is not None:
        omp = r["original_max_position_embeddings"]
        lines.insert(
            1,
            f"  context: {j['max_context']} tokens (YaRN factor {r['factor']:g} x {omp}; the "
            "memory estimate is the plain-RoPE model's)",
        )
    for a in j["alternatives"]:
        lines.append(
            f"  also fits: tp={a['tp']} pp={a['pp']} cp={a['cp']} dp={a['dp']} "
            f"mbs={a['micro_batch_size']} recompute={a['recompute']} {a['memory_gib_per_gpu']} GiB"
        )
    return "\n".join(lines)


def _engine_lines(j: dict) -> list[str]:
    """The phases' lines: the engine's pool, KV cache and refit, where one is colocated."""
    b = j["breakdown_gib"]
    if j["engine"] is None:
        return [f"    training phase {b['train_phase']} (no colocated engine)"]
    # a Gated DeltaNet model's sequence: a KV cache that grows only in its full-attention layers
    rec, conv = b["engine_linear_state_per_sequence"], b["engine_conv_state_per_sequence"]
    linear = [
        f"    per sequence: KV cache {b['engine_kv_per_sequence']} (full-attention layers), "
        f"Gated DeltaNet states {round(rec + conv, 3)} (recurrent {rec}, conv {conv}); the KV "
        f"cache holds {j['engine_sequences']} sequences"
    ] if rec + conv else []  # fmt: skip
    return [
        f"    {j['engine']} ({j['engine_mem_fraction']:g} of the GPU) {b['engine_pool']}: its "
        f"weights {b['engine_weights']}, KV cache {b['vllm_kv_cache']}; while training "
        f"{b['vllm_train_phase']}",
        *linear,
        f"    refit: bucket {b['refit_bucket']}, one full tensor {b['refit_full_param']}, at its "
        f"instant {b['refit_phase']}",
        f"    training phase {b['train_phase']}, generation phase {b['generate_phase']}",
    ]


def _in_flight(j: dict) -> str:
    """What 1F1B holds at the worst stage: micro-batches, or interleaved chunk micro-batches."""
    tokens = round(j["in_flight_tokens"])
    if j["virtual_pipeline_size"] == 1:
        return f"{j['in_flight_micro_batches']} micro-batch(es) in flight, {tokens} tokens"
    return (
        f"{j['in_flight_micro_batches']} chunk micro-batch(es) of 1/{j['virtual_pipeline_size']} "
        f"of the stage in flight, {tokens} tokens' worth of its layers"
    )


def _logprob_lines(j: dict) -> list[str]:
    """The log-prob pass's line, where the step has one (--logprob-batch-size)."""
    if j["logprob_tokens"] is None:
        return []
    b = j["breakdown_gib"]
    return [
        f"    log-prob pass ({j['logprob_tokens']} tokens per micro-batch): logits "
        f"{b['logprob_logits']}, at its peak {b['logprob_phase']}"
    ]


def _split(j: dict) -> str:
    """The uneven pipeline stages' layers, first to last ("" for an even split)."""
    if j["pp_first_stage_layers"] is None and j["pp_last_stage_layers"] is None:
        return ""
    return f" (stage layers {','.join(map(str, j['stage_layers']))})"
