"""CPU/gloo shims for megatron-core: only CPU runs import this module.

megatron-core assumes CUDA in a few places that the CPU test runs (gloo process groups, torch CPU
build) reach. `install()` patches exactly those places and nothing else; it is idempotent and
returns the names of the shims it installed the first time (an empty list afterwards):

1. `torch.cuda.current_device()` returns "cpu": megatron-core uses it as the device of buffers
   (DDP grad buffers, GlobalMemoryBuffer, p2p shape exchange, attention scratch).
2. `megatron.core.pipeline_parallel.schedules` sees a `torch` (`TorchOnCpu`) whose tensor
   factories called with `device="cuda"` allocate on the CPU: the three forward_backward_*
   functions create their `total_num_tokens` counter with `zeros(..., device="cuda")` (0.16.1,
   schedules.py, forward_backward_no_pipelining and both pipelined schedules). Only that
   module's view of torch changes.

3. Mixture of experts (megatron-core 0.16.1; `install_moe()`, for MoE models only):
   `moe_utils.te_general_gemm` is bound only when Transformer Engine imports, yet the router's
   gating linear reads it (a NameError on CPU): it is set to None, the unfused torch path
   (moe_utils.py:1192). The alltoall dispatcher makes a
   `torch.cuda.Stream()` at build time: its module sees `TorchOnCpu`, whose `cuda.Stream()` is a
   stream with nothing to wait for. Its split sizes go through `maybe_move_tensor_to_cpu(...,
   as_numpy=True)`, which converts CUDA tensors only, so on CPU they stay tensors and gloo's
   all_to_all_single refuses them: the dispatcher's copy returns a list for CPU tensors (only
   reached at expert parallelism > 1, which is not run here).

Two more CPU needs are not patches; callers apply them (4 after initialize_model_parallel, 5 is
merged by megatron_ba.megatron.model.transformer_config when CUDA is absent):

4. RNG: `seed_model_parallel_rng(seed)` calls megatron-core's
   `model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)`, whose tracker never
   touches CUDA generators (the default tracker calls torch.cuda.manual_seed and
   torch.cuda.get_rng_state). Call it after `initialize_model_parallel`. megatron-core 0.10 has
   no such argument: there a tracker with a null `fork()` is installed instead (same effect).
5. `TransformerConfig(batch_p2p_sync=False)`: the batched p2p path otherwise calls
   torch.cuda.synchronize(); see `CPU_CONFIG_OVERRIDES`.

One more patch, for sequence parallelism only:

6. Sequence parallelism with the local spec (`install_sequence_parallel()`, only for a config
   with sequence_parallel; megatron-core 0.16.1 and 0.19.2, transformer/torch_norm.py):
   `WrappedTorchNorm` asserts `not config.sequence_parallel`. Under SP a norm runs on this TP
   rank's slice of the sequence, so its weight's gradient is this slice's share: Transformer
   Engine's norms mark their weights `sequence_parallel = True`, and megatron-core's
   finalize_model_grads sums such gradients over the TP group
   (`_allreduce_non_tensor_model_parallel_grads`), as it does for the router's weight. The shim
   builds the same torch norm (from the config as if SP were off) and marks its parameters the
   same way; with SP off it is megatron-core's own path. The sequence scatter and gather are
   megatron-core's own: gloo runs reduce_scatter_tensor and all_gather_into_tensor (torch 2.13).

And one for Qwen3.5's Gated DeltaNet layers only:

7. `install_gated_delta_net()` (megatron-core 0.16.1: ssm/gated_delta_net.py; 0.19.2:
   ssm/gated_delta_net/common.py): GatedDeltaNet refuses to build without the
   flash-linear-attention package (`HAVE_FLA`), whose CUDA/Triton kernels do not run on CPU.
   With `deterministic_mode` (merged by megatron_ba.megatron.model for hybrid models on CPU)
   megatron-core takes its own torch paths for the conv1d and the gated delta rule; only fla's
   `l2norm` of q and k is still called. The shim sets HAVE_FLA and binds `l2norm` to the same
   arithmetic in torch (x * rsqrt(sum(x^2) + 1e-6) over the head's channels; transformers'
   Qwen3.5 `l2norm`).

The causal attention mask is passed explicitly by megatron_ba.megatron.grpo_step, which avoids
megatron-core's `get_default_causal_mask` (it allocates on "cuda"); that works on GPUs too.
Nothing here is needed (or wanted) on a GPU cluster.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

# TransformerConfig fields a CPU run must set (merged by megatron_ba.megatron.model on CPU).
CPU_CONFIG_OVERRIDES: dict[str, Any] = {
    "batch_p2p_sync": False,
    "use_cpu_initialization": True,
    # Fusions are CUDA kernels (or need Apex/TE); their unfused paths are plain torch.
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "persist_layer_norm": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
}

_installed: list[str] = []


def _cpu_current_device() -> str:
    return "cpu"


class _NullEvent:
    """A CUDA event that has always happened (what a `_NullStream` records)."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullStream:
    """A CUDA stream's waiting interface with nothing to wait for (a CPU process has no streams)."""

    def record_event(self, event: Any = None) -> _NullEvent:
        return _NullEvent()

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _CudaOnCpu(types.SimpleNamespace):
    """torch.cuda as seen by a shimmed megatron-core module: `current_stream()` is a stream
    with nothing to wait for (megatron-core >= 0.19's DDP grad sync waits on it for CUDA-graph
    replays), `current_device()` is "cpu"; everything else is torch.cuda's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_stream(device: Any = None) -> _NullStream:
        return _NullStream()

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> _NullStream:
        return _NullStream()


# The tensor factories whose `device="cuda"` TorchOnCpu turns into the CPU.
_FACTORIES = frozenset({"tensor", "zeros", "empty", "ones", "full", "as_tensor", "arange"})


class TorchOnCpu(types.SimpleNamespace):
    """torch as seen by a shimmed module that allocates on "cuda" literally: its tensor
    factories (`_FACTORIES`) put such tensors on the CPU (the literal "cpu" is what this
    CPU-only shim exists for) and `cuda` is `_CudaOnCpu`; everything else is torch's. Used here
    for megatron-core's schedules and DDP buckets and by the NeMo-Aligner CPU shims."""

    cuda = _CudaOnCpu()

    def __getattr__(self, name: str) -> Any:
        obj = getattr(torch, name)
        if name not in _FACTORIES:
            return obj

        @functools.wraps(obj)
        def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                kwargs["device"] = "cpu"
            return obj(*args, **kwargs)

        return factory


def _no_cuda_rng_state(*args: Any, **kwargs: Any) -> None:
    return None  # no CUDA generator in a CPU process: nothing to save


def _set_no_cuda_rng_state(*args: Any, **kwargs: Any) -> None:
    return None  # ... and nothing to restore


def _modules_seeing_cpu_torch() -> list[types.ModuleType]:
    """The megatron-core modules whose view of torch is shimmed: the schedules (their
    `total_num_tokens` counter) and, where it exists, the DDP bucket module (0.19's
    `start_grad_sync` reads `torch.cuda.current_stream()`)."""
    import importlib

    out = []
    for name in (
        "megatron.core.pipeline_parallel.schedules",
        "megatron.core.distributed.param_and_grad_buffer",
    ):
        try:
            out.append(importlib.import_module(name))
        except ImportError:
            continue
    return out


def install() -> list[str]:
    """Install the CPU shims (idempotent). Returns the shims installed by this call."""
    if torch.cuda.is_available():
        raise RuntimeError(
            "megatron_ba.megatron.cpu_compat: CUDA is available; these shims are for CPU-only "
            "runs and would route megatron-core's CUDA buffers to the CPU"
        )
    done: list[str] = []
    if torch.cuda.current_device is not _cpu_current_device:
        torch.cuda.current_device = _cpu_current_device
        done.append("torch.cuda.current_device")
    for module in _modules_seeing_cpu_torch():
        if not isinstance(module.torch, TorchOnCpu):
            module.torch = TorchOnCpu()
            done.append(f"{module.__name__.removeprefix('megatron.core.')}.torch")
    from megatron.core.tensor_parallel import random as mcore_random

    # megatron-core 0.10 (NeMo-Aligner's) has no _get_cuda_rng_state helper to shim: its
    # recomputation reads torch.cuda directly, and recomputation is not run on CPU there.
    helper = getattr(mcore_random, "_get_cuda_rng_state", None)
    if helper is not None and helper is not _no_cuda_rng_state:
        mcore_random._get_cuda_rng_state = _no_cuda_rng_state
        mcore_random._set_cuda_rng_state = _set_no_cuda_rng_state
        done.append("tensor_parallel.random._get/_set_cuda_rng_state")
    _installed.extend(done)
    return done


def _split_sizes_on_cpu(move: Any) -> Any:
    """megatron-core's `maybe_move_tensor_to_cpu` that also turns CPU tensors into the list
    `as_numpy` asks for (split sizes for all_to_all_single; see shim 3)."""

    @functools.wraps(move)
    def wrapper(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.tolist()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    wrapper.megatron_ba_shim = True
    return wrapper


def install_moe() -> list[str]:
    """Shim 3: the MoE router and token dispatchers on CPU (idempotent; returns the shims this
    call installed). megatron_ba.megatron.model.transformer_config calls it for a MoE spec, so
    that a dense run patches nothing of megatron-core's MoE modules."""
    install()
    try:
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
    except ImportError:
        return []
    done = []
    if getattr(moe_utils, "te_general_gemm", "absent") is not None:
        moe_utils.te_general_gemm = None
        done.append("transformer.moe.moe_utils.te_general_gemm")
    if not isinstance(token_dispatcher.torch, TorchOnCpu):
        token_dispatcher.torch = TorchOnCpu()
        done.append("transformer.moe.token_dispatcher.torch")
    move = getattr(token_dispatcher, "maybe_move_tensor_to_cpu", None)
    if move is not None and not getattr(move, "megatron_ba_shim", False):
        token_dispatcher.maybe_move_tensor_to_cpu = _split_sizes_on_cpu(move)
        done.append("transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu")
    _installed.extend(done)
    return done


class _ConfigWithoutSequenceParallel:
    """A TransformerConfig seen with sequence_parallel off (what WrappedTorchNorm accepts)."""

    sequence_parallel = False

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _norm_with_sequence_parallel(new: Any) -> Any:
    """WrappedTorchNorm.__new__ that also builds a norm under sequence parallelism: the same
    torch norm, its parameters marked `sequence_parallel` (summed over TP; see shim 6)."""

    @functools.wraps(new)
    def wrapper(cls, config, *args: Any, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return new(cls, config, *args, **kwargs)
        norm = new(cls, _ConfigWithoutSequenceParallel(config), *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    wrapper.megatron_ba_shim = True
    return wrapper


def install_sequence_parallel() -> list[str]:
    """Shim 6: the local spec's norms under sequence parallelism (idempotent; returns the shims
    this call installed). megatron_ba.megatron.model.transformer_config calls it for a CPU
    config with sequence_parallel, so that a run without SP patches nothing of the norms."""
    install()
    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    if getattr(cls.__new__, "megatron_ba_shim", False):
        return []
    cls.__new__ = staticmethod(_norm_with_sequence_parallel(cls.__new__))
    done = ["transformer.torch_norm.WrappedTorchNorm"]
    _installed.extend(done)
    return done


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2norm in torch: x / sqrt(sum of squares + eps) over `dim` (shim 7)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def install_gated_delta_net() -> list[str]:
    """Shim 7: megatron-core's GatedDeltaNet without flash-linear-attention (idempotent;
    returns the shims this call installed)."""
    install()
    import importlib

    done = []
    for name in ("megatron.core.ssm.gated_delta_net.common", "megatron.core.ssm.gated_delta_net"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "HAVE_FLA"):
            if not module.HAVE_FLA:
                module.HAVE_FLA = True
                module.l2norm = _l2norm
                done.append(f"{name.removeprefix('megatron.core.')}.l2norm")
            break
    _installed.extend(done)
    return done


def installed() -> list[str]:
    """The shims installed in this process so far."""
    return list(_installed)


def seed_model_parallel_rng(seed: int) -> None:
    """megatron-core's model-parallel RNG set-up without CUDA generators (need 4)."""
    import inspect

    from megatron.core import tensor_parallel

    seed_fn = tensor_parallel.model_parallel_cuda_manual_seed
    params = inspect.signature(seed_fn).parameters
    if "inference_rng_tracker" in params:
        # force_reset: a tracker made earlier in this process by a plain get_cuda_rng_tracker()
        # (megatron-core's default, which reads CUDA generator states) would otherwise be kept
        # and fail on the first add().
        reset = {"force_reset_rng": True} if "force_reset_rng" in params else {}
        seed_fn(seed, inference_rng_tracker=True, **reset)
    else:
        # megatron-core 0.10 (NeMo-Aligner 0.7.0's) has no CUDA-free tracker: its
        # CudaRNGStatesTracker.add calls torch.cuda.get_rng_state. Install one whose fork() is a
        # null context, as 0.16.1's inference tracker is: TP-region dropout then draws from
        # torch's default (CPU) generator, seeded below.
        from megatron.core.tensor_parallel import random as mcore_random

        mcore_random._CUDA_RNG_STATE_TRACKER = _CpuRNGTracker()
        mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.manual_seed(seed)


class _CpuRNGTracker:
    """megatron-core's RNG-tracker interface with no CUDA state (megatron-core 0.10 on CPU)."""

    def reset(self) -> None:
        pass

    def is_initialized(self) -> bool:
        return True

    def get_states(self) -> dict:
        return {}

    def set_states(self, states) -> None:
        pass

    def add(self, name, seed) -> None:
        pass

    def fork(self, name=None):
        import contextlib

        return contextlib.nullcontext()
