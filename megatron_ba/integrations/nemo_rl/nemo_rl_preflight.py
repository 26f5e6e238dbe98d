"""The run's inputs through NeMo-RL v0.7.0's own code, before grpo.setup starts any worker.

run_grpo_balanced's main() calls `check_or_stop(master_config)` after the config check:

1. the tokenizer: NeMo-RL's get_tokenizer(policy.tokenizer), as examples/run_grpo.py gets it;
2. the data: NeMo-RL's setup_response_data without environments (its data sets, data processors
   and AllTaskProcessedDataset, as run_grpo.py's setup builds them); every file must hold rows;
   one training batch of grpo.num_prompts_per_step prompts through rl_collate_fn, as grpo.setup's
   loader (drop_last) makes it;
3. the reward: the verify worker of NeMo-RL's math environment (HFVerifyWorker for the `math`
   verifier), called in this process with env.<env_name>.math_verify_impl as MathEnvironment.step
   passes it, scores for each row of that batch a response stating the row's ground truth (must
   score 1) and one stating ground truth + 1 (must score 0);
4. without a CUDA GPU (`torch.cuda.is_available()` false) it prints one line and exits with
   NEEDS_GPU (69, integrations/exit_status.py):

   [megatron-ba] nemo_rl: checked MasterConfig, N training / M validation prompts through
   NeMo-RL's data processors, math reward on a batch of B (B right, B wrong); NeMo-RL's GRPO with
   policy.megatron_cfg needs CUDA GPUs (megatron-core policy, vLLM generation) and none is
   visible: stopping before training

   (one line on stdout). With a GPU the run goes on. A failed check raises ValueError naming the
   file, row or key (exit status 1). The Slurm launcher's own statuses are 75 (preempted) and 2
   (the Ray cluster did not form); slurm/README.md.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from dataclasses import dataclass

from megatron_ba.integrations.exit_status import NEEDS_GPU


@dataclass
class Summary:
    train_prompts: int
    val_prompts: int
    batch: int


def check_or_stop(master_config) -> Summary:
    """Run the checks; without a CUDA GPU print the one line and exit with NEEDS_GPU."""
    import torch

    summary = run_checks(master_config)
    if not torch.cuda.is_available():
        print(needs_gpu_line(master_config, summary), flush=True)
        sys.exit(NEEDS_GPU)
    return summary


def run_checks(master_config) -> Summary:
    """Tokenizer, data, one collated batch, the reward on it (ValueError naming what is wrong)."""
    from nemo_rl.algorithms.utils import get_tokenizer

    tokenizer = get_tokenizer(master_config.policy["tokenizer"])
    train, val = load_data(master_config, tokenizer)
    batch = first_batch(master_config, train)
    score_batch(master_config, batch)
    val_prompts = 0 if val is None else len(val)
    return Summary(_prompts(train), val_prompts, len(batch["idx"]))


def needs_gpu_line(master_config, s: Summary) -> str:
    policy = master_config.policy
    if (policy.get("megatron_cfg") or {}).get("enabled", False):
        key, what = "policy.megatron_cfg", "megatron-core policy"
    else:
        key, what = "policy.dtensor_cfg", "DTensor policy"
    backend = (policy.get("generation") or {}).get("backend", "vllm")
    generation = "vLLM" if backend == "vllm" else backend
    return (
        f"[megatron-ba] nemo_rl: checked MasterConfig, {s.train_prompts} training / "
        f"{s.val_prompts} validation prompts through NeMo-RL's data processors, math reward on a "
        f"batch of {s.batch} ({s.batch} right, {s.batch} wrong); NeMo-RL's GRPO with {key} needs "
        f"CUDA GPUs ({what}, {generation} generation) and none is visible: stopping before "
        f"training"
    )


def _prompts(dataset) -> int:
    # use_multiple_dataloader: a data set per task
    return sum(len(d) for d in dataset.values()) if isinstance(dataset, dict) else len(dataset)


def _blank_file(path) -> bool:
    """A local file holding only white space (a hub id or folder is not a file)."""
    if not path or not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return not f.read(1 << 16).strip() and os.path.getsize(path) <= 1 << 16


@contextlib.contextmanager
def _each_file_checked():
    """setup_response_data's loader of each configured data set, wrapped so that a file that
    does not load, or loads without rows, is named (NeMo-RL would merge it silently, or fail
    deep in `datasets` without the path)."""
    import nemo_rl.data.utils as data_utils

    load = data_utils.load_response_dataset

    def checked(cfg, *args, **kwargs):
        where = cfg.get("data_path") or cfg.get("dataset_name")
        if _blank_file(cfg.get("data_path")):  # `datasets` fails on it with a bare StopIteration
            raise ValueError(f"{where}: no rows (the file is empty)")
        try:
            data = load(cfg, *args, **kwargs)
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0]  # the cause stays in the chain
            raise ValueError(
                f"{where}: NeMo-RL's {cfg.get('dataset_name')} did not load it: "
                f"{type(e).__name__}: {first}"
            ) from e
        if len(data.dataset) == 0:
            raise ValueError(f"{where}: no rows (NeMo-RL's {cfg.get('dataset_name')} read it)")
        return data

    data_utils.load_response_dataset = checked
    try:
        yield
    finally:
        data_utils.load_response_dataset = load


def load_data(master_config, tokenizer):
    """(train, validation) as run_grpo.py's setup_response_data builds them, without starting
    the environments (env_configs=None); on a copy, since it rewrites the data config."""
    from nemo_rl.data.utils import setup_response_data

    with _each_file_checked():
        return setup_response_data(tokenizer, copy.deepcopy(master_config.data), None)


def first_batch(master_config, train):
    """The first training batch as grpo.setup's loader makes it (rl_collate_fn, drop_last),
    unshuffled and in this process."""
    from nemo_rl.data.collate_fn import rl_collate_fn
    from torchdata.stateful_dataloader import StatefulDataLoader

    n = int(master_config.grpo["num_prompts_per_step"])
    dataset = next(iter(train.values())) if isinstance(train, dict) else train
    loader = StatefulDataLoader(
        dataset,
        batch_size=n,
        shuffle=False,
        collate_fn=rl_collate_fn,
        drop_last=True,
        num_workers=0,
    )
    batch = next(iter(loader), None)
    if batch is None:
        raise ValueError(
            f"grpo.num_prompts_per_step: {n} prompts per step, but the training data holds "
            f"{len(dataset)}; NeMo-RL's loader (drop_last) would yield no batch"
        )
    return batch


def _actor_class(remote_cls):
    """The Python class behind a @ray.remote class: Ray's actor class inherits from its modified
    class, which keeps the original as `__ray_actor_class__` (ray/actor.py, _modify_class)."""
    return remote_cls.__ray_actor_class__


def _math_env(master_config) -> tuple[str, dict]:
    from nemo_rl.data.datasets.utils import extract_necessary_env_names

    names = extract_necessary_env_names(master_config.data)
    if names != ["math"]:
        raise ValueError(
            f"data.default.env_name: the preflight scores with NeMo-RL's math environment "
            f"(env.math), got the environment(s) {sorted(names)}"
        )
    cfg = (master_config.env or {}).get("math")
    if cfg is None:
        raise ValueError("env.math: missing; the data names the math environment")
    return "math", cfg


def verifier(master_config):
    """(verify, math_verify_impl, env name): the math environment's worker method, in-process."""
    from nemo_rl.environments.math_environment import MathEnvironment

    name, cfg = _math_env(master_config)
    kind = cfg.get("verifier_type") or "math"
    if kind != "math":
        raise ValueError(
            f"env.{name}.verifier_type: the preflight writes math answers, got {kind!r}"
        )
    worker_cls = _actor_class(MathEnvironment).WORKER_CLASS_DICT[kind]
    worker = _actor_class(worker_cls)()
    # MathEnvironment.step's default when the key is absent
    return worker.verify, cfg.get("math_verify_impl", "hf_math_verify"), name


def answers(ground_truth: str, impl: str) -> tuple[str, str]:
    """(right, wrong) responses in the form the verifier reads: DAPO's verifier takes the last
    `Answer: ...` line, math-verify a boxed expression; ground truth + 1 is never equal to it."""
    if impl == "dapo_math_verify":
        return f"Answer: {ground_truth}", f"Answer: {ground_truth} + 1"
    return f"\\boxed{{{ground_truth}}}", f"\\boxed{{{ground_truth} + 1}}"


def score_batch(master_config, batch) -> None:
    """Each row's right response must score 1, its wrong one 0 (ValueError naming the row)."""
    verify, impl, name = verifier(master_config)
    truths = [str(info["ground_truth"]) for info in batch["extra_env_info"]]
    pairs = [answers(t, impl) for t in truths]
    right = verify([r for r, _ in pairs], truths, math_verify_impl=impl)
    wrong = verify([w for _, w in pairs], truths, math_verify_impl=impl)
    for idx, truth, (r, w), s_r, s_w in zip(batch["idx"], truths, pairs, right, wrong, strict=True):
        for response, score, want in ((r, s_r, 1.0), (w, s_w, 0.0)):
            if float(score) != want:
                raise ValueError(
                    f"data.train row {idx}: ground truth {truth!r}: env.{name}.math_verify_impl="
                    f"{impl} scored the response {response!r} {score}, expected {want}"
                )
