"""CPU shims that let NeMo-Aligner 0.7.0 and NeMo 2.1 run without GPU, apex, TE or TRT-LLM.

`train_grpo` installs them when torch sees no CUDA device (a GPU cluster runs NeMo-Aligner's
container, where none of this is needed or wanted); tests/nemo/ installs them too. `install()`
applies every shim once per process and returns their names. Each is a fact about NeMo 2.1 /
megatron-core 0.10 on a CPU-only torch 2.13 build (seen 2026-12-01/02, docs/nemo-aligner.md):

1. `nemo_aligner.utils.trt_llm` imports `tensorrt_llm` at the top: a stand-in module whose
   `GPTGenerateTRTLLM` raises if used (the configs set `trt_llm.enable: False`).
2. `nemo...megatron.gemma2.gemma2_spec` imports Transformer Engine at the top: a stand-in; and
   `megatron_gpt_model.get_specs` (which builds every spec eagerly, TE ones included) returns
   megatron-core's `get_gpt_layer_local_spec()`.
3. `nlp_overrides.HAVE_APEX = True`: `NLPDDPStrategy.__init__` raises without apex, though the
   plain DDP path it takes on CPU uses no apex code. The apex-only optimizer classes it tests
   with isinstance (`McoreDistributedOptimizer`, `MegatronDistributedFusedAdam`) are defined as
   classes nothing is an instance of (a `NameError` when saving a checkpoint otherwise).
4. `get_megatron_pretrained_bert_models` returns [] (it imports a bert spec needing TE and hits
   NeMo 2.1's `NameError: ApexGuardDefaults` on the no-apex path).
5. `build_model.set_defaults_if_not_set_tensor_model_parallel_attributes` (an apex import there)
   is megatron-core's function of the same name.
6. `NVIDIA_PYTORCH_VERSION=24.07` (NeMo's `_enable_nvidia_optimizations` parses it).
7. megatron-core on CPU: `megatron_ba.megatron.cpu_compat.install()` (torch.cuda.current_device
   -> "cpu", the schedules' `torch.zeros(device="cuda")` on CPU), `torch.Tensor.cuda` and NeMo's
   `ModelPT.cuda` returning themselves, `torch.cuda.synchronize` a no-op, the legacy
   `torch.cuda.FloatTensor`-style constructors the CPU ones, megatron-core 0.10's CUDA RNG
   tracker `fork()` a null context (dropout 0 in the configs: no random stream is consumed),
   and `fused_softmax.get_default_causal_mask` (NeMo's generation passes no mask) on the CPU.
8. NeMo's optimizer parameter groups use names imported from apex only: `listify_model` is
   apex's (a module or a list -> a list) and `FusedLayerNorm`, `FastLayerNorm`,
   `MixedFusedRMSNorm` a class nothing is an instance of (no apex norms exist here).
9. Modules that allocate with a literal `device="cuda"` (NeMo's text generation, NeMo-Aligner's
   distributed helpers, trainer and actor, NeMo's gradient clipping) see
   `cpu_compat.TorchOnCpu`, whose tensor factories put such tensors on the CPU; NeMo's
   `clip_grad_norm_fp32` gets apex's `multi_tensor_l2norm` as a plain torch L2 norm of the
   per-tensor norms.
10. `MegatronBaseModel.setup_transformer_engine_cp_groups` is a no-op: it creates a CUDA stream
    for Transformer Engine's context-parallel layers, which the local spec has none of.
11. megatron-core 0.10's checkpoint writer calls torch's private `_write_item` with its pre-2.6
    signature; torch 2.13's takes a stream-transform list and a serialization format first and
    last: an adapter passes no transforms and torch.save's format (what 2.4 wrote).
12. NeMo's sharded optimizer state (`optimizer_sharded_state_dict`, plain torch optimizers)
    shards every per-parameter state tensor by the parameter's shape; torch's Adam keeps `step`
    as a 0-d tensor per parameter, which fails that check: 0-d state stays a plain tensor of the
    state dict (common state, saved and restored as it is; the same on every rank).
13. megatron-core 0.10 reads a checkpoint's common.pt with `torch.load` and no `weights_only`;
    since torch 2.6 that means True, which refuses the NeMo config objects NeMo saved there: its
    checkpoint strategies load with `weights_only=False` (a run's own checkpoints; 2.4's default).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
import types

import torch

_done: list[str] = []

# Modules that allocate with device="cuda" literally (shim 9).
_CUDA_LITERAL_MODULES = (
    "nemo_aligner.utils.distributed",
    "nemo_aligner.algorithms.reinforce",
    "nemo_aligner.utils.utils",
    "nemo_aligner.models.nlp.gpt.megatron_gpt_reinforce_actor",
    "nemo.collections.nlp.modules.common.text_generation_utils",
    "nemo.collections.nlp.modules.common.text_generation_strategy",
    "nemo.collections.nlp.modules.common.megatron.clip_grads",
)
# megatron-core 0.10's modules that torch.load a checkpoint's pickles (shim 13).
_CHECKPOINT_LOADERS = ("megatron.core.dist_checkpointing.strategies.common",)
_LEGACY_TYPES = ("FloatTensor", "LongTensor", "ByteTensor", "IntTensor", "BoolTensor",
                 "HalfTensor", "BFloat16Tensor", "DoubleTensor")  # fmt: skip


class _NoTRTLLM:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            "TRT-LLM is not available in a CPU environment: set "
            "trainer.reinforce.trt_llm.enable=False (NeMo's megatron generation is used then)"
        )


def _stub_module(name: str, **attrs) -> None:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    mod.__stub__ = True
    sys.modules[name] = mod


class _TorchLoadsCheckpoints(types.SimpleNamespace):
    """torch for megatron-core 0.10's checkpoint strategies: `load` as before torch 2.6."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def load(*args, **kwargs):
        kwargs.setdefault("weights_only", False)
        return torch.load(*args, **kwargs)


def _is_scalar(value) -> bool:
    return torch.is_tensor(value) and value.dim() == 0


def _l2norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """apex's `multi_tensor_l2norm` (the L2 norm over a list of tensors), in torch."""
    norms = [torch.linalg.vector_norm(t.float()) for t in tensor_lists[0]]
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


@functools.lru_cache(maxsize=32)
def _causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _install_import_stubs() -> list[str]:
    os.environ.setdefault("NVIDIA_PYTORCH_VERSION", "24.07")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    _stub_module("nemo_aligner.utils.trt_llm", GPTGenerateTRTLLM=_NoTRTLLM)
    _stub_module(
        "nemo.collections.nlp.models.language_modeling.megatron.gemma2.gemma2_spec",
        get_gemma2_layer_spec=lambda *a, **k: None,
    )
    return ["NVIDIA_PYTORCH_VERSION", "nemo_aligner.utils.trt_llm", "gemma2_spec"]


def _install_torch_on_cpu() -> list[str]:
    from megatron.core.fusions import fused_softmax

    from megatron_ba.megatron import cpu_compat

    done = cpu_compat.install()
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.synchronize = lambda *args, **kwargs: None
    for name in _LEGACY_TYPES:
        setattr(torch.cuda, name, getattr(torch, name))
    # megatron-core 0.10's RNG tracker needs CUDA generators; ours has a null fork() there.
    cpu_compat.seed_model_parallel_rng(1234)
    fused_softmax.get_default_causal_mask = _causal_mask
    return [*done, "torch.Tensor.cuda", "torch.cuda.synchronize", "torch.cuda.*Tensor",
            "cuda_rng_tracker.fork", "fused_softmax.get_default_causal_mask"]  # fmt: skip


def _install_nemo_model() -> list[str]:
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from nemo.collections.nlp.models import nlp_model
    from nemo.collections.nlp.models.language_modeling import (
        megatron_base_model,
        megatron_gpt_model,
    )
    from nemo.collections.nlp.modules.common.megatron import build_model, megatron_utils
    from nemo.collections.nlp.modules.common.megatron import utils as megatron_nemo_utils
    from nemo.core.classes.modelPT import ModelPT

    megatron_gpt_model.get_specs = lambda *args, **kwargs: get_gpt_layer_local_spec()
    megatron_utils.get_megatron_pretrained_bert_models = lambda: []
    nlp_model.get_megatron_pretrained_bert_models = lambda: []
    build_model.set_defaults_if_not_set_tensor_model_parallel_attributes = (
        tensor_parallel.layers.set_defaults_if_not_set_tensor_model_parallel_attributes
    )
    megatron_base_model.MegatronBaseModel.setup_transformer_engine_cp_groups = lambda self: None
    ModelPT.cuda = lambda self, device=None: self
    done = ["megatron_gpt_model.get_specs", "get_megatron_pretrained_bert_models",
            "build_model.set_defaults_if_not_set_tensor_model_parallel_attributes",
            "setup_transformer_engine_cp_groups", "ModelPT.cuda"]  # fmt: skip
    if not hasattr(megatron_nemo_utils, "listify_model"):
        megatron_nemo_utils.listify_model = lambda model: (
            model if isinstance(model, list) else [model]
        )
        done.append("megatron.utils.listify_model")
    for name in ("FusedLayerNorm", "FastLayerNorm", "MixedFusedRMSNorm"):
        if not hasattr(megatron_nemo_utils, name):
            setattr(megatron_nemo_utils, name, type(name, (), {}))
            done.append(f"megatron.utils.{name}")
    return done


def _install_strategy_and_checkpoints() -> list[str]:
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from nemo.collections.nlp.modules.common.megatron import clip_grads
    from nemo.collections.nlp.parts import nlp_overrides

    from megatron_ba.megatron import cpu_compat

    nlp_overrides.HAVE_APEX = True
    done = ["nlp_overrides.HAVE_APEX"]
    for name in ("McoreDistributedOptimizer", "MegatronDistributedFusedAdam"):
        if not hasattr(nlp_overrides, name):
            setattr(nlp_overrides, name, type(name, (), {}))
            done.append(f"nlp_overrides.{name}")
    for name in _CUDA_LITERAL_MODULES:
        importlib.import_module(name).torch = cpu_compat.TorchOnCpu()
    done.append("device='cuda' literals")
    clip_grads.multi_tensor_applier = lambda op, flag, lists, *a: op(2048 * 32, flag, lists, *a)
    clip_grads.amp_C = types.SimpleNamespace(multi_tensor_l2norm=_l2norm)
    done.append("clip_grads.multi_tensor_l2norm")
    # torch's checkpoint writer module, as megatron-core imported its _write_item from it
    torch_fs = sys.modules[filesystem_async._write_item.__module__]
    if "transforms" in inspect.signature(torch_fs._write_item).parameters:

        def write_item(stream, data, write_item, storage_key):
            return torch_fs._write_item(
                torch_fs._StorageWriterTransforms(), stream, data, write_item, storage_key,
                torch_fs.SerializationFormat.TORCH_SAVE,
            )  # fmt: skip

        filesystem_async._write_item = write_item
        done.append("filesystem_async._write_item")
    sharding = nlp_overrides.optim_state_to_sharding_state

    def scalars_in_common(optim_state_dict, id_to_sharded_param_map, exclude_keys=()):
        # state_dict() shares the optimizer's own per-parameter dicts: copy before taking out
        state = {pid: dict(st) for pid, st in optim_state_dict["state"].items()}
        scalars = {
            pid: {k: st.pop(k) for k in [k for k, v in st.items() if _is_scalar(v)]}
            for pid, st in state.items()
        }
        optim_state_dict["state"] = state
        sharding(optim_state_dict, id_to_sharded_param_map, exclude_keys)
        for pid, kept in scalars.items():
            optim_state_dict["state"][pid].update(kept)

    nlp_overrides.optim_state_to_sharding_state = scalars_in_common
    done.append("optim_state_to_sharding_state(step)")
    for name in _CHECKPOINT_LOADERS:
        importlib.import_module(name).torch = _TorchLoadsCheckpoints()
    done.append("dist_checkpointing torch.load(weights_only=False)")
    return done


def install() -> list[str]:
    """Apply the shims (idempotent); returns the names applied by this call."""
    if _done:
        return []
    if torch.cuda.is_available():
        raise RuntimeError("cpu_shims: CUDA is available; these shims are for CPU-only runs")
    done = _install_import_stubs()
    done += _install_torch_on_cpu()
    done += _install_nemo_model()
    done += _install_strategy_and_checkpoints()
    _done.extend(done)
    return done


def installed() -> list[str]:
    return list(_done)
