"""What a rollout engine returns for each generated response."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Sample:
    """One generated response."""

    token_ids: list[int]  # the response only; ends with EOS when `finished`
    text: str
    finished: bool  # stopped at EOS (False: cut at max_tokens)
