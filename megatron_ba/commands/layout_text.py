"""`megatron-ba layout`'s text output: the plan's JSON (planning.cluster_layout.Plan.to_json)
as lines a reader scans, term by term."""

from __future__ import annotations


def render(j: dict) -> str:
    """The plan as text: its layout, each memory term, the engine, the overrides."""
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
        f"({'distributed' if j['distributed_optimizer'] else 'replicated'}{_states(j)}) "
        f"{b['optimizer']}",
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


def _states(j: dict) -> str:
    """The Adam states' kind where it is not the default fp32 (--optimizer-states)."""
    return "" if j["optimizer_states"] == "fp32" else f", {j['optimizer_states']} states"
