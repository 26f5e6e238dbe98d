"""The experts vLLM routed each token to, per request: the rollout side of routing replay.

    class Worker(RoutingCaptureExtension): ...     # mixed into vLLM's worker (vllm_worker.py)
    llm.collective_rpc("megatron_ba_capture_routing")          # once, after the engine starts
    outs = llm.generate(...)
    records = llm.collective_rpc("megatron_ba_take_routing")[0]   # {request id: (tokens, experts)}
    experts = match_routing(records, prompt_ids, completion_ids)  # [P, L, K] per completion

vLLM 0.32's own `enable_return_routed_experts` needs Model Runner V2, which needs Triton (refused
on CPU). Here every MoE layer's router (`MoERunner.router`, a `BaseRouter`) gets a capture
function (`set_capture_fn`: the logical expert ids of each forward's rows, before any expert
placement mapping), and the model runner's `execute_model` is wrapped: after each forward the
rows are mapped to requests and positions from the runner's own record of that forward (the
batch's request order, `query_start_loc`, the `positions` and `input_ids` buffers), so every
captured row is stored under (request, position) with the token it was. Any batch composition
maps alike (checked: mixed prefill and decode batches of 12 requests); chunked prefill and
preemption (a recompute files the same positions again) should too, but no run here has hit them.
The engine runs eager (no CUDA graphs, which would skip the Python capture); the rows come from
worker 0 (engine_tp 1 on CPU; not run on GPUs).
Prefix caching would skip the cached prompt positions: the engine turns it off when it
captures. The front end matches each completion to the record whose tokens are exactly its
prompt + response but the last token (the one token sampled and never fed): identical sequences
(two samples of one prompt that agree token for token) are interchangeable.
"""

from __future__ import annotations

from functools import partial

import torch


class RoutingCaptureExtension:
    """Methods of vLLM's worker (through worker_extension_cls): capture, then take records."""

    def megatron_ba_capture_routing(self) -> int:
        """Install the capture on every MoE router; the number of MoE layers."""
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        runner = self.model_runner
        routers = [m.router for m in runner.get_model().modules() if isinstance(m, MoERunner)]
        if not routers or not all(isinstance(r, BaseRouter) for r in routers):
            raise ValueError("rollout.routing_replay: the engine's model has no BaseRouter MoE")
        rows: list = [None] * len(routers)
        for i, router in enumerate(routers):
            router.set_capture_fn(partial(_store, rows, i))
        self._megatron_ba_rows, self._megatron_ba_routing = rows, {}
        if not getattr(runner, "_megatron_ba_wrapped", False):
            runner.execute_model = partial(_execute, self, runner.execute_model)
            runner._megatron_ba_wrapped = True
        return len(routers)

    def megatron_ba_take_routing(self) -> dict:
        """{request id: (token ids, [P][L][K] expert ids)} of every request since the last
        take (positions 0..P-1, each fed once at least), and forget them."""
        records, self._megatron_ba_routing = self._megatron_ba_routing, {}
        out = {}
        for req_id, by_pos in records.items():
            count = max(by_pos) + 1
            if len(by_pos) != count:
                raise RuntimeError(
                    f"rollout.routing_replay: request {req_id} has experts for {len(by_pos)} of "
                    f"positions 0..{count - 1} (a prefix-cache hit?)"
                )
            tokens = [by_pos[p][0] for p in range(count)]
            experts = torch.stack([by_pos[p][1] for p in range(count)])
            out[req_id] = (tokens, experts.tolist())  # plain lists cross vLLM's RPC as sent
        return out


def _store(rows: list, layer: int, topk_ids: torch.Tensor) -> None:
    rows[layer] = topk_ids.detach().cpu().clone()  # a host copy the next forward cannot reuse


def _execute(worker, original, scheduler_output, *args, **kwargs):
    """The runner's execute_model, then this forward's captured rows filed by request."""
    rows = worker._megatron_ba_rows
    rows[:] = [None] * len(rows)
    out = original(scheduler_output, *args, **kwargs)
    total = int(scheduler_output.total_num_scheduled_tokens)
    if total and rows[0] is not None:
        _file_rows(worker.model_runner, rows, total, worker._megatron_ba_routing)
    return out


def _file_rows(runner, rows: list, total: int, records: dict) -> None:
    """Row r of this forward is token input_ids[r] at positions[r] of the request whose
    [query_start_loc[j], query_start_loc[j + 1]) holds r (the runner's batch order)."""
    if any(r is None or r.shape[0] < total for r in rows):
        raise RuntimeError("rollout.routing_replay: a MoE layer captured fewer rows than tokens")
    experts = torch.stack([r[:total] for r in rows], dim=1)  # [total, L, K]
    num_reqs = runner.input_batch.num_reqs
    starts = runner.query_start_loc.np[: num_reqs + 1].tolist()
    positions = runner.positions
    positions = positions if isinstance(positions, torch.Tensor) else positions.cpu
    positions = positions[:total].cpu().tolist()
    tokens = runner.input_ids.cpu[:total].tolist()
    for j, req_id in enumerate(runner.input_batch.req_ids[:num_reqs]):
        record = records.setdefault(req_id, {})
        for r in range(starts[j], starts[j + 1]):
            record[positions[r]] = (tokens[r], experts[r])


def match_routing(records: dict, prompt_ids: list[list[int]], completions: list[list[list[int]]]):
    """Per prompt, per completion: the [len(prompt) + len(response) - 1, L, K] experts of the
    record whose tokens are exactly prompt + response[:-1]; RuntimeError when one has none."""
    pool: dict[tuple, list] = {}
    for tokens, experts in records.values():
        pool.setdefault(tuple(tokens), []).append(experts)
    out = []
    for prompt, group in zip(prompt_ids, completions, strict=True):
        row = []
        for response in group:
            key = tuple(prompt) + tuple(response[:-1])
            if not pool.get(key):
                raise RuntimeError(
                    "rollout.routing_replay: no captured routing for a completion of "
                    f"{len(prompt)} prompt and {len(response)} response tokens"
                )
            row.append(torch.tensor(pool[key].pop(), dtype=torch.int16))
        out.append(row)
    return out
