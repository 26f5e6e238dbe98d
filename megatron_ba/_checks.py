"""Input checks shared by the core modules: each error names the argument and what is wrong."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: unknown value {value!r}; expected one of {', '.join(choices)}")


def as_tensor_1d(name: str, value) -> torch.Tensor:
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if t.dim() != 1:
        raise ValueError(f"{name}: must be 1-D (one entry per sequence), got {tuple(t.shape)}")
    return t


def check_finite_1d(name: str, value) -> torch.Tensor:
    """A 1-D real tensor with no NaN/Inf, returned as float64 (exact for integer lengths)."""
    t = as_tensor_1d(name, value)
    if t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{name}: must be real numbers, got dtype {t.dtype}")
    t = t.to(torch.float64)
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{name}: must be finite, got {t[i].item()} at index {i} ({int(bad.sum())} bad)"
        )
    return t


def check_integer_1d(name: str, value) -> torch.Tensor:
    t = as_tensor_1d(name, value)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{name}: must be an integer tensor, got dtype {t.dtype}")
    return t.long()


def check_same_length(**tensors: torch.Tensor) -> None:
    sizes = {name: t.shape[0] for name, t in tensors.items()}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{n}={s}" for n, s in sizes.items())
        raise ValueError(f"{', '.join(sizes)}: must have one entry per sequence each, got {listed}")
