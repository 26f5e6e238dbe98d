"""Which sequences go together: token-budget micro-batches and token-balanced DP shards.

Pure host-side arithmetic on Python ints (the lengths a batch's layout is planned from), so the
same inputs give the same layout on every rank, with no collective:

    rows = balanced_dp_shards(seq_tokens, dp)[dp_rank]            # this DP rank's sequences
    bins = token_budget_microbatches([seq_tokens[i] for i in rows], budget, cost="padded")
    cu = thd_cu_seqlens([seq_tokens[rows[j]] for j in bins[0]], cp=cp)  # packed (THD) offsets

Why splitting a prompt group across DP ranks (or micro-batches) is exact: the loss plan's
statistics are summed over the whole DP group before any weight is computed
(collectives.StatisticsReducer, aggregation.plan_statistics), so a sequence's weight does not
depend on where its group's other members are.

A sequence's tokens are what the model sees of it: prompt + response (its padded length, rounded
up to a multiple of 2 x CP when CP > 1, megatron-core's load-balanced CP layout needs that).
"""

from __future__ import annotations

KEY = "parallel.max_tokens_per_microbatch"
COSTS = ("padded", "packed")


def _check_lengths(seq_tokens: list[int]) -> list[int]:
    out = [int(t) for t in seq_tokens]
    if any(t < 0 for t in out):
        raise ValueError(f"seq_tokens: must be >= 0 tokens per sequence, got min {min(out)}")
    return out


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def microbatch_cost(seq_tokens: list[int], cost: str) -> int:
    """Positions the model runs for these sequences in one micro-batch: rows x longest when each
    micro-batch is padded to its longest sequence ("padded", CPU), their sum when packed ("packed",
    THD on GPU)."""
    if cost == "padded":
        return len(seq_tokens) * max(seq_tokens, default=0)
    if cost == "packed":
        return sum(seq_tokens)
    raise ValueError(f"cost: unknown value {cost!r}; expected one of {', '.join(COSTS)}")


def token_budget_microbatches(
    seq_tokens: list[int], budget: int, *, cost: str = "padded", multiple: int = 1
) -> list[list[int]]:
    """Indices of `seq_tokens` per micro-batch, each micro-batch costing at most `budget` tokens.

    Deterministic: sequences sorted by length, longest first (ties: lower index first), are
    filled into micro-batches in that order, a new one opened when the next would exceed the
    budget (with padded micro-batches this keeps similar lengths together, so little padding).
    Each micro-batch lists its indices in increasing order; micro-batches come longest first.
    Every sequence lands in exactly one micro-batch; counts per micro-batch may differ.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"{KEY}: must be a positive number of tokens or null, got {budget!r}")
    if cost not in COSTS:
        raise ValueError(f"cost: unknown value {cost!r}; expected one of {', '.join(COSTS)}")
    lengths = [round_up(t, multiple) for t in _check_lengths(seq_tokens)]
    if lengths and max(lengths) > budget:
        i = max(range(len(lengths)), key=lambda j: lengths[j])
        raise ValueError(
            f"{KEY}: {budget} tokens is below sequence {i}'s {lengths[i]} tokens (prompt + "
            f"response{', rounded up to a multiple of 2 x CP' if multiple > 1 else ''}); a "
            "sequence is never split across micro-batches: raise the budget"
        )
    order = sorted(range(len(lengths)), key=lambda j: (-lengths[j], j))
    bins: list[list[int]] = []
    current: list[int] = []
    for j in order:
        trial = [lengths[k] for k in current] + [lengths[j]]
        if current and microbatch_cost(trial, cost) > budget:
            bins.append(sorted(current))
            current = []
        current.append(j)
    if current:
        bins.append(sorted(current))
    return bins


def fixed_count_microbatches(n: int, m: int) -> list[list[int]]:
    """`m` contiguous micro-batches of `n` sequences, sizes differing by at most one (the first
    n % m get one more): `parallel.micro_batch_size` need not divide a rank's sequences."""
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"num_microbatches: must be an integer >= 1, got {m!r}")
    if m > n:
        raise ValueError(
            f"num_microbatches: {m} is more than this rank's {n} sequences (every micro-batch "
            "needs at least one)"
        )
    base, extra = divmod(n, m)
    out, start = [], 0
    for i in range(m):
        size = base + (1 if i < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def balanced_dp_shards(seq_tokens: list[int], dp: int) -> list[list[int]]:
    """Row indices per DP rank, balanced by tokens (then by sequence count).

    Longest-processing-time first: sequences sorted longest first (ties: lower index first), each
    given to the rank holding the fewest tokens so far (ties: fewer sequences, then the lower
    rank). Deterministic; groups may be split across ranks (exact, see the module docstring).
    Each rank's indices are returned in increasing order. Every rank gets at least one sequence
    when there are at least `dp` of them.
    """
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp: must be an integer >= 1, got {dp!r}")
    lengths = _check_lengths(seq_tokens)
    if len(lengths) < dp:
        raise ValueError(f"dp: {dp} ranks need at least {dp} sequences, got {len(lengths)}")
    load = [(0, 0, r) for r in range(dp)]  # (tokens, sequences, rank)
    shards: list[list[int]] = [[] for _ in range(dp)]
    for j in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        r = min(range(dp), key=lambda k: load[k])
        tokens, count, _ = load[r]
        load[r] = (tokens + lengths[j], count + 1, r)
        shards[r].append(j)
    return [sorted(s) for s in shards]


def thd_cu_seqlens(seq_tokens: list[int], *, cp: int = 1) -> tuple[list[int], list[int]]:
    """(cu_seqlens, cu_seqlens_padded) of a packed (THD) micro-batch, for megatron-core's
    PackedSeqParams: offsets of each sequence in the concatenation, [0, t_0, t_0 + t_1, ...];
    the padded offsets round every sequence up to a multiple of 2 x CP (what Transformer
    Engine's load-balanced CP split of a THD batch needs; equal to cu_seqlens when CP = 1)."""
    lengths = _check_lengths(seq_tokens)
    multiple = 2 * cp if cp > 1 else 1
    cu, cu_pad = [0], [0]
    for t in lengths:
        cu.append(cu[-1] + t)
        cu_pad.append(cu_pad[-1] + round_up(t, multiple))
    return cu, cu_pad
