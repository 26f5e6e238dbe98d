"""What differs between the megatron-core releases this project runs on, decided by feature.

Supported: megatron-core 0.16.1 (Python 3.11, `.venv`) through 0.19.x (Python >= 3.12,
`.venv-current`), both tested in CI; docs/versions.md has the table. NeMo-Aligner's own
environment runs megatron-core 0.10, where only the NeMo-Aligner actor is supported.

Each helper below asks the installed megatron-core (or torch) whether it has a feature (a
parameter, a module) and never compares version strings, so a patch release that back-ports a
change is read correctly. The one exception is the loss-scale table of
megatron_ba.megatron.loss_scale: a change in what the schedules divide by leaves no signature to
detect, and both ends of the range are proven by the layout check.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


@functools.cache
def _parameters(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def cp_shard_batch(batch: dict[str, Any], cp_group) -> dict[str, Any]:
    """megatron-core's own context-parallel split of a padded batch (`get_batch_on_this_cp_rank`).

    0.19 made `is_hybrid_cp` a required positional argument (hybrid CP needs packed `cu_seqlens`,
    which a padded batch has not); 0.16 has no such argument.
    """
    from megatron.core.utils import get_batch_on_this_cp_rank

    if "is_hybrid_cp" in _parameters(get_batch_on_this_cp_rank):
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
    return get_batch_on_this_cp_rank(batch, cp_group=cp_group)


def has_pg_collection() -> bool:
    """Whether models take explicit process groups (`megatron.core.process_groups_config`,
    0.14 on): the layout check's CP-at-the-loss model needs it."""
    import importlib.util

    return importlib.util.find_spec("megatron.core.process_groups_config") is not None


def check_checkpoint_readable(ckpt_dir) -> None:
    """ValueError when this megatron-core cannot read the torch_dist checkpoint in `ckpt_dir`.

    megatron-core 0.19 writes a checkpoint's common (non-tensor) state inside its `.distcp`
    files and still reads the older separate `common.pt`; 0.16.1 reads `common.pt` only, and
    without this check fails with a FileNotFoundError deep inside its loader. The feature: 0.19's
    serialization module knows the older layout as the legacy one.
    """
    from pathlib import Path

    from megatron.core import package_info
    from megatron.core.dist_checkpointing import serialization

    folder = Path(ckpt_dir)
    if (folder / "common.pt").exists() or hasattr(serialization, "_legacy_common_state_exists"):
        return
    raise ValueError(
        f"checkpoint: {str(folder)!r} keeps its common state inside its .distcp files (written "
        f"by megatron-core 0.19 or newer), which megatron-core {package_info.__version__} cannot "
        "read: load it with megatron-core >= 0.19 (.venv-current, scripts/setup_current_env.sh), "
        "or convert it to Hugging Face there (megatron-ba convert CKPT OUT --to hf)"
    )


@functools.cache
def sdpa_has_enable_gqa() -> bool:
    """Whether torch's scaled_dot_product_attention takes `enable_gqa` (torch 2.5 on): grouped
    key/value heads without expanding them. A builtin has no signature to read, so ask it."""
    import torch

    q, kv = torch.zeros(1, 2, 1, 1), torch.zeros(1, 1, 1, 1)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True
