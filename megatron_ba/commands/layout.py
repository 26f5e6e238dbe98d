"""`megatron-ba layout`: a TP/PP/CP/DP layout, micro-batch size and per-GPU memory estimate.

    megatron-ba layout --model Qwen2.5-Math-7B --nodes 4 --gpus-per-node 8 --gpu-mem 80 \\
        --max-response-len 3584 --group-size 16 --prompts-per-step 32
    megatron-ba layout --model path/to/config.json --nodes 8 --gpus-per-node 8 --gpu-mem 80 \\
        --max-response-len 12288 --json

Models: the presets Qwen2.5-Math-7B, Qwen3-1.7B, Qwen2.5-32B, or any HF config.json (or a folder
holding one). The estimate's terms and assumptions: megatron_ba/planning/memory.py; how it
compares with layouts known to run: docs/cluster-planning.md.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_ba.planning.cluster_layout import NoLayoutFits, propose
from megatron_ba.planning.memory import VLLMShare, load_model
from megatron_ba.recipe import VLLM_GPU_MEMORY_UTILIZATION


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name or HF config.json (or its folder)")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--gpu-mem", type=float, required=True, metavar="GIB", help="GiB per GPU")
    p.add_argument("--max-response-len", type=int, required=True, help="tokens per response")
    p.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt (default 512)")
    p.add_argument("--group-size", type=int, help="responses per prompt (grpo.group_size)")
    p.add_argument("--prompts-per-step", type=int, help="prompts per step (grpo.prompts_per_step)")
    p.add_argument(
        "--vllm-gpu-util",
        type=float,
        default=VLLM_GPU_MEMORY_UTILIZATION,
        help=(
            "colocated vLLM's share of the GPU while it generates (the recipe's "
            f"rollout.gpu_memory_utilization; default {VLLM_GPU_MEMORY_UTILIZATION}; 0: no vLLM)"
        ),
    )
    p.add_argument(
        "--vllm-awake",
        action="store_true",
        help="vLLM keeps its memory while the policy trains (no sleep mode / offload)",
    )
    p.add_argument(
        "--headroom", type=float, default=0.1, help="fraction of the GPU kept free (default 0.1)"
    )
    for name in ("tp", "pp", "cp"):
        p.add_argument(f"--{name}", type=int, help=f"pin {name} (estimate a given layout)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    for flag, value in (
        ("--group-size", args.group_size),
        ("--prompts-per-step", args.prompts_per_step),
    ):
        if value is not None and value < 1:
            print(f"layout: {flag}: must be >= 1, got {value}", file=sys.stderr)
            return 2
    if not 0 <= args.vllm_gpu_util < 1:
        print(
            f"layout: --vllm-gpu-util: must be in [0, 1), got {args.vllm_gpu_util}", file=sys.stderr
        )
        return 2
    vllm = VLLMShare(args.vllm_gpu_util, sleeps=not args.vllm_awake) if args.vllm_gpu_util else None
    try:
        shape = load_model(args.model)
        plan = propose(
            shape,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            gpu_mem_gib=args.gpu_mem,
            max_response_len=args.max_response_len,
            prompt_len=args.prompt_len,
            group_size=args.group_size,
            prompts_per_step=args.prompts_per_step,
            vllm=vllm,
            headroom=args.headroom,
            only={"tp": args.tp, "pp": args.pp, "cp": args.cp},
        )
    except NoLayoutFits as e:
        print(f"layout: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"layout: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
        return 0
    print(_text(plan))
    return 0


def _text(plan) -> str:
    j = plan.to_json()
    b = j["breakdown_gib"]
    lines = [
        f"{j['model']} ({j['params_billion']} B parameters) on {j['nodes']} x {j['gpus_per_node']}"
        f" GPUs of {j['gpu_mem_gib']} GiB, {j['seq_len']} tokens per sequence:",
        f"  layout: tp={j['tp']} pp={j['pp']} cp={j['cp']} dp={j['dp']}, micro-batch "
        f"{j['micro_batch_size']} sequence(s) = {j['micro_batch_tokens']} tokens "
        f"({j['micro_batch_tokens_per_gpu']} per GPU), recompute={j['recompute']}",
        f"  per GPU (worst pipeline stage {j['worst_stage']}): {j['memory_gib_per_gpu']} GiB",
        f"    weights {b['weights']}  gradients {b['grads']}  optimizer (distributed) "
        f"{b['optimizer']}",
        f"    activations {b['activations']} (no recompute {b['activations_no_recompute']}, "
        f"full recompute {b['activations_full_recompute']})",
        f"    logits {b['logits']} (naive {b['logits_naive']}, chunked {b['logits_chunked']})",
        f"    vLLM while training {b['vllm_train_phase']}; training phase {b['train_phase']}, "
        f"generation phase {b['generate_phase']} (vLLM KV cache {b['vllm_kv_cache']})",
        "  recipe overrides: " + " ".join(j["overrides"]),
    ]
    for a in j["alternatives"]:
        lines.append(
            f"  also fits: tp={a['tp']} pp={a['pp']} cp={a['cp']} dp={a['dp']} "
            f"mbs={a['micro_batch_size']} recompute={a['recompute']} {a['memory_gib_per_gpu']} GiB"
        )
    return "\n".join(lines)
