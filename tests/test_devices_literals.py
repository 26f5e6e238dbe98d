"""Devices are parameters: no literal "cpu"/"cuda" device in megatron_ba/ (perf/ included).

The scan (tests/device_literals.py) is shown to catch each kind of literal on planted code, and
to pass what is allowed (`.cpu()` host copies, `device.type == "cuda"`, a device parameter).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from device_literals import ALLOWED, literal_devices, violations  # noqa: E402


def test_no_literal_devices_outside_the_allowlist():
    assert violations(ROOT) == []


def test_allowlist_names_existing_files():
    assert all((ROOT / p).is_file() for p in ALLOWED)


@pytest.mark.parametrize(
    ("code", "what"),
    [
        ("x = t.cuda()", ".cuda()"),
        ("m.cuda(non_blocking=True)", ".cuda()"),
        ("d = torch.device('cpu')", "torch.device('cpu')"),
        ("d = torch.device('cuda', 1)", "torch.device('cuda')"),
        ("z = torch.zeros(3, device='cuda')", "device='cuda'"),
        ("z = torch.ones(3, device='cuda:1')", "device='cuda:1'"),
        ("z = torch.empty(3, device='cpu')", "device='cpu'"),
        ("y = t.to('cuda:0')", ".to('cuda:0')"),
        ("y = t.to('cpu', torch.float32)", ".to('cpu')"),
    ],
)
def test_scan_catches_a_planted_literal(code, what):
    assert [w for _, w in literal_devices(code)] == [what]


def test_scan_catches_a_planted_literal_in_the_tree(tmp_path):
    pkg = tmp_path / "megatron_ba" / "train"
    pkg.mkdir(parents=True)
    (pkg / "update.py").write_text("def f(t):\n    return t.to('cuda')\n")
    assert violations(tmp_path) == ["megatron_ba/train/update.py:2: .to('cuda')"]


@pytest.mark.parametrize(
    "code",
    [
        "h = t.cpu()",  # a host copy
        "ok = device.type == 'cuda'",
        "z = torch.zeros(3, device=ctx.device)",
        "z = torch.zeros_like(t, device=t.device)",
        "y = t.to(ctx.device)",
        "y = t.to(torch.float32)",
        '"""device="cuda" in a docstring"""',
    ],
)
def test_scan_passes_what_is_allowed(code):
    assert literal_devices(code) == []
