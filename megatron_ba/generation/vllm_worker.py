"""Methods added to vLLM's worker (`LLM(worker_extension_cls=...)`): in-memory weight refit.

vLLM mixes this class into its worker in the engine's own process; the trainer calls the methods
through `llm.collective_rpc("megatron_ba_load_bucket", args=(handle, manifest))`, which runs them
on every worker of the engine (each TP worker receives the full tensors and keeps its shard:
the model's own `load_weights` splits them, and stacks q/k/v and gate/up as it does for a
checkpoint). Imported by vLLM by qualified name only; it must not import the trainer's modules
beyond weight_buckets.
"""

from __future__ import annotations

import torch

from megatron_ba.generation.weight_buckets import open_bucket, unpack


class RefitWorkerExtension:
    """A refit in three calls: begin, one load per bucket (HF names, full shapes), finish.

    vLLM's CPU (and quantised GPU) layers repack their weights after loading, so a plain
    `load_weights` finds empty parameters: the refit goes through vLLM's layer-wise reload (the
    machinery of `reload_weights`), spread over the buckets. `begin` restores every layer to
    checkpoint format, each layer is processed back into kernel format as soon as all its weights
    have arrived, and `finish` processes what is left (and puts back layers that got nothing).
    """

    def megatron_ba_begin_refit(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())

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

        finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)
