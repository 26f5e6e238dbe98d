"""NeMo-RL's training step on CPU, for the tests in this folder: what `Policy.train` and its
DTensor (automodel) worker's `train` run for one global batch, built from NeMo-RL's own functions.

    grads, loss, metrics = train_step(model, data, loss_fn, policy_cfg, dp_rank, dp_size)

In the worker's order: `Policy._shard_for_train` (the DP shards: plain, length-sorted dynamic
batches or packed sequences, by `policy_cfg`), `process_global_batch` (the global valid sequence and
token counts, all-reduced over DP), `get_microbatch_iterator`, `automodel_forward_backward` with
`LossPostProcessor` (`prepare_loss_input`, `SequencePackingLossWrapper`, the loss multiplied by
dp_size). Not NeMo-RL's: the model (`TokenModel`), the gradient mean over DP ranks that FSDP does
(an all-reduce here), and `cpu_device()`, which maps the worker's `.cuda()` / `device="cuda"`
calls to the CPU. The DP ranks are gloo processes (or one process, dp_size 1).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
import torch.distributed as dist
from nemo_rl.models.automodel.data import get_microbatch_iterator, process_global_batch
from nemo_rl.models.automodel.train import LossPostProcessor, automodel_forward_backward
from nemo_rl.models.policy.lm_policy import Policy


class TokenModel(torch.nn.Module):
    """Logits of each position from its own token alone (a [V, V] table): packing sequences
    together, or padding them, changes no logit, so every layout sees the same log-probs."""

    def __init__(self, vocab: int, seed: int = 0, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        # drawn in float32 whatever the dtype: the float64 reference holds the same values
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=g).to(dtype))

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        return self.table[input_ids]


def policy_config(batching: str, *, mbs: int = 2, mb_tokens: int = 48) -> dict:
    """The keys of NeMo-RL's `policy` config the step reads, for "plain", "dynamic" or "packed"."""
    return {
        "train_micro_batch_size": mbs,
        "make_sequence_length_divisible_by": 1,
        "dynamic_batching": {
            "enabled": batching == "dynamic",
            "train_mb_tokens": mb_tokens,
            "sequence_length_round": 4,
        },
        "sequence_packing": {
            "enabled": batching == "packed",
            "train_mb_tokens": mb_tokens,
            "algorithm": "modified_first_fit_decreasing",
        },
    }


def _shards(data, cfg: dict, batch_size: int, dp_size: int):
    """NeMo-RL's own Policy._shard_for_train, on a policy holding only what it reads (the
    batching arguments as Policy.__init__ builds them from the same config)."""
    policy = SimpleNamespace(
        data_parallel_size=dp_size,
        cfg=cfg,
        use_dynamic_batches=cfg["dynamic_batching"]["enabled"],
        use_sequence_packing=cfg["sequence_packing"]["enabled"],
        dynamic_batching_args={
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "sequence_length_round": cfg["dynamic_batching"]["sequence_length_round"],
            "max_tokens_per_microbatch": 0,
        },
        sequence_packing_args={
            "algorithm": cfg["sequence_packing"]["algorithm"],
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "sequence_length_pad_multiple": cfg["make_sequence_length_divisible_by"],
        },
    )
    return Policy._shard_for_train(policy, data, batch_size)


@contextlib.contextmanager
def cpu_device():
    """The worker's CUDA calls (`tensor.cuda()`, `torch.tensor(..., device="cuda")`) on the CPU."""
    tensor, cuda = torch.tensor, torch.Tensor.cuda

    def on_cpu(*args, device=None, **kwargs):
        return tensor(*args, device="cpu" if device == "cuda" else device, **kwargs)

    torch.tensor, torch.Tensor.cuda = on_cpu, lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.tensor, torch.Tensor.cuda = tensor, cuda


def train_step(model, data, loss_fn, cfg: dict, dp_rank: int, dp_size: int, *, steps: int = 1,
               step: int = 0):  # fmt: skip
    """Global batch `step` of `steps` (NeMo-RL's train_global_batch_size = data.size / steps)
    through NeMo-RL's step: (gradients averaged over DP as FSDP does, the summed loss over ranks
    and micro-batches, the metrics of every micro-batch of every rank)."""
    group = dist.group.WORLD
    tokenizer = SimpleNamespace(eos_token_id=0, pad_token_id=0)
    step_rows = data.size // steps
    with cpu_device():
        shard = _shards(data, cfg, step_rows, dp_size)[dp_rank]
        gb = process_global_batch(
            shard, loss_fn, group, batch_idx=step, batch_size=step_rows // dp_size
        )
        iterator, iterator_len = get_microbatch_iterator(
            gb["batch"], cfg, cfg["train_micro_batch_size"], None, tokenizer
        )
        post = LossPostProcessor(loss_fn, cfg, None, None, None, 1, dp_size,
                                 enable_seq_packing=cfg["sequence_packing"]["enabled"])  # fmt: skip
        model.zero_grad()
        results = automodel_forward_backward(
            model, iterator, post,
            global_valid_seqs=gb["global_valid_seqs"], global_valid_toks=gb["global_valid_toks"],
            dp_size=dp_size, cp_size=1, num_global_batches=1, num_valid_microbatches=iterator_len,
        )  # fmt: skip
    grads = [p.grad.clone() for p in model.parameters()]
    for g in grads:  # FSDP's gradient mean over the DP ranks
        dist.all_reduce(g)
        g /= dp_size
    loss = torch.stack([r[0].detach().to(torch.float64) for r in results[:iterator_len]]).sum()
    dist.all_reduce(loss)
    return grads, loss, [r[1] for r in results[:iterator_len]]


def step_rows(data, cfg: dict, dp_rank: int, dp_size: int, *, steps: int, step: int) -> list:
    """The `row` entries of the data that global batch `step` of `steps` holds on this DP rank,
    as NeMo-RL's sharding and `get_batch` give them to its worker."""
    step_rows = data.size // steps
    shard = _shards(data, cfg, step_rows, dp_size)[dp_rank]
    return shard.get_batch(batch_idx=step, batch_size=step_rows // dp_size)["row"].tolist()


def policy_train(model, data, loss_fn, cfg: dict, lr: float = 0.0, *, steps: int = 1,
                 record: list | None = None) -> dict:  # fmt: skip
    """`Policy.train`'s result for one DP rank (dp_size 1) over `steps` optimizer steps of
    data.size / steps rows each (NeMo-RL's train_global_batch_size), each step followed by a
    plain SGD update of rate `lr` (the optimizer's stand-in): the losses, and every micro-batch's
    metrics with the keys the worker adds to them (lr, global_valid_seqs, global_valid_toks), as
    lists under `all_mb_metrics` (what grpo_train reads). `record` gets, per step, its rows, the
    parameters it started from, its gradients and its loss."""
    rows = data.size // steps
    all_mb_metrics: dict[str, list] = {}
    losses, norms = [], []
    for step in range(steps):
        with cpu_device():
            gb = process_global_batch(data, loss_fn, dist.group.WORLD, batch_idx=step,
                                      batch_size=rows)  # fmt: skip
        params = [p.detach().clone() for p in model.parameters()]
        grads, loss, metrics = train_step(model, data, loss_fn, cfg, 0, 1, steps=steps, step=step)
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads, strict=True):
                p -= lr * g
        if record is not None:
            record.append({"rows": slice(step * rows, (step + 1) * rows), "params": params,
                           "grads": grads, "loss": loss})  # fmt: skip
        for m in metrics:
            m |= {"lr": lr, "global_valid_seqs": float(gb["global_valid_seqs"]),
                  "global_valid_toks": float(gb["global_valid_toks"])}  # fmt: skip
            for k, v in m.items():
                all_mb_metrics.setdefault(k, []).append(v)
        losses.append(loss)
        norms.append(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
    return {"loss": torch.stack(losses), "grad_norm": torch.stack(norms),
            "all_mb_metrics": all_mb_metrics}  # fmt: skip


def logprobs(model, input_ids: torch.Tensor) -> torch.Tensor:
    """NeMo-RL's convention for [B, S] ids: position t holds log p(x_t | x_<t), position 0 holds
    0 (what Policy.get_logprobs returns; float32, no gradient)."""
    with torch.no_grad():
        logits = model(input_ids[:, :-1])
        lp = torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(input_ids.shape[0], 1), lp], dim=1)
