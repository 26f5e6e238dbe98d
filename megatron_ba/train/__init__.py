"""The `local` training backend: GRPO on megatron-core with vLLM rollouts, on one machine."""

import os
from pathlib import Path


def warmstart_cache() -> Path:
    """Where warm starts are cached when a command is not told (--cache-dir): outside the
    checkout, keyed by content (train/warmstart.py's cache_key), so every clone and run on this
    machine trains a warm start once. $XDG_CACHE_HOME/megatron-ba, default ~/.cache/megatron-ba."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatron-ba"
