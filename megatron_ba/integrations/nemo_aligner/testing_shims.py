"""CPU shims that let NeMo-Aligner 0.7.0's real classes run without GPU, apex, TE or TRT-LLM.

Only the tests in tests/nemo/ import this module (never the actor, the trainer or train_grpo: a
GPU cluster runs NeMo-Aligner's container, where none of this is needed or wanted).
`install()` applies every shim once per process and returns their names; each is a fact about
NeMo 2.1 / megatron-core 0.10 on a CPU-only torch build (seen 2026-12-01, see
docs/nemo-aligner.md):

1. `nemo_aligner.utils.trt_llm` imports `tensorrt_llm` at the top: a stand-in module whose
   `GPTGenerateTRTLLM` raises if used (our configs set `trt_llm.enable: False`).
2. `nemo...megatron.gemma2.gemma2_spec` imports Transformer Engine at the top: a stand-in; and
   `megatron_gpt_model.get_specs` (which builds every spec eagerly, TE ones included) returns
   megatron-core's `get_gpt_layer_local_spec()`.
3. `nlp_overrides.HAVE_APEX = True`: `NLPDDPStrategy.__init__` raises without apex, though the
   plain DDP path it takes on CPU uses no apex code.
4. `get_megatron_pretrained_bert_models` returns [] (it imports a bert spec needing TE and hits
   NeMo 2.1's `NameError: ApexGuardDefaults` on the no-apex path).
5. `build_model.set_defaults_if_not_set_tensor_model_parallel_attributes` (an apex import there)
   is megatron-core's function of the same name.
6. `NVIDIA_PYTORCH_VERSION=24.07` (NeMo's `_enable_nvidia_optimizations` parses it).
7. megatron-core on CPU: `megatron_ba.megatron.cpu_compat.install()` (torch.cuda.current_device
   -> "cpu", the schedules' `torch.zeros(device="cuda")` on CPU), plus `torch.Tensor.cuda`
   returning the tensor itself (NeMo-Aligner moves batches with `.cuda(non_blocking=True)`), and
   megatron-core 0.10's CUDA RNG tracker `fork()` as a null context (its tracker needs CUDA
   generators; the test configs use dropout 0, so no random stream is consumed).
8. NeMo's optimizer parameter groups (`megatron.utils.get_params_for_weight_decay_optimization`)
   use names imported from apex only (`NameError` without it): `listify_model` is defined as
   apex's (a module or a list -> a list) and `FusedLayerNorm`, `FastLayerNorm`,
   `MixedFusedRMSNorm` as a class nothing is an instance of (no apex norms exist here).
"""

from __future__ import annotations

import os
import sys
import types

_done: list[str] = []


class _NoTRTLLM:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            "TRT-LLM is not available in this CPU test environment: set "
            "trainer.reinforce.trt_llm.enable=False (NeMo's megatron generation is used then)"
        )


def _stub_module(name: str, **attrs) -> None:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    mod.__stub__ = True
    sys.modules[name] = mod


def install() -> list[str]:
    """Apply the shims (idempotent); returns the names applied by this call."""
    if _done:
        return []
    import torch

    if torch.cuda.is_available():
        raise RuntimeError("testing_shims: CUDA is available; these shims are for CPU-only tests")
    os.environ.setdefault("NVIDIA_PYTORCH_VERSION", "24.07")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    done = ["NVIDIA_PYTORCH_VERSION"]

    _stub_module("nemo_aligner.utils.trt_llm", GPTGenerateTRTLLM=_NoTRTLLM)
    done.append("nemo_aligner.utils.trt_llm")
    _stub_module(
        "nemo.collections.nlp.models.language_modeling.megatron.gemma2.gemma2_spec",
        get_gemma2_layer_spec=lambda *a, **k: None,
    )
    done.append("gemma2_spec")

    from megatron_ba.megatron import cpu_compat

    done += cpu_compat.install()
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    done.append("torch.Tensor.cuda")

    from megatron.core import tensor_parallel

    # megatron-core 0.10's RNG tracker needs CUDA generators; ours has a null fork() there.
    cpu_compat.seed_model_parallel_rng(1234)
    done.append("cuda_rng_tracker.fork")

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from nemo.collections.nlp.models.language_modeling import megatron_gpt_model
    from nemo.collections.nlp.modules.common.megatron import build_model, megatron_utils
    from nemo.collections.nlp.parts import nlp_overrides

    megatron_gpt_model.get_specs = lambda *args, **kwargs: get_gpt_layer_local_spec()
    done.append("megatron_gpt_model.get_specs")
    nlp_overrides.HAVE_APEX = True
    done.append("nlp_overrides.HAVE_APEX")
    megatron_utils.get_megatron_pretrained_bert_models = lambda: []
    from nemo.collections.nlp.models import nlp_model

    nlp_model.get_megatron_pretrained_bert_models = lambda: []
    done.append("get_megatron_pretrained_bert_models")
    build_model.set_defaults_if_not_set_tensor_model_parallel_attributes = (
        tensor_parallel.layers.set_defaults_if_not_set_tensor_model_parallel_attributes
    )
    done.append("build_model.set_defaults_if_not_set_tensor_model_parallel_attributes")
    from nemo.collections.nlp.modules.common.megatron import utils as megatron_nemo_utils

    if not hasattr(megatron_nemo_utils, "listify_model"):
        megatron_nemo_utils.listify_model = lambda model: (
            model if isinstance(model, list) else [model]
        )
        done.append("megatron.utils.listify_model")
    for name in ("FusedLayerNorm", "FastLayerNorm", "MixedFusedRMSNorm"):
        if not hasattr(megatron_nemo_utils, name):
            setattr(megatron_nemo_utils, name, type(name, (), {}))
            done.append(f"megatron.utils.{name}")
    _done.extend(done)
    return done


def installed() -> list[str]:
    return list(_done)
