"""Devices, recomputation, CP agreement and TE names on a 2-rank gloo world (CP=2), one spawn.

tests/devices_worker.py runs every check in the same world and saves its findings; each test
below asserts on one part of them. About 35 s on 2 CPU cores (the spawn and two megatron-core
imports dominate).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("megatron.core")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.stack,
]  # one 2-rank spawn: ~35 s idle, ~110 s on a loaded machine


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    import torch

    from megatron_ba.parallel.world import free_port, spawn

    sys.path.insert(0, str(Path(__file__).parent))
    import devices_worker

    out = tmp_path_factory.mktemp("devices") / "found.pt"
    spawn(devices_worker.worker, 2, (2, free_port(), str(out), str(ROOT)))
    return torch.load(out)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_gives_the_same_gradients_bit_for_bit(found, mode):
    r = found[f"recompute_{mode}"]
    # The recompute path was really taken: megatron-core's tensor_parallel.checkpoint ran
    # (full: once per layer and micro-batch; selective: once per core attention and micro-batch).
    assert r["calls"] == 4, r
    assert r["same_names"] and r["loss_equal"], r
    assert r["max_diff"] == 0.0, r


def test_cp_agreement_accepts_matching_and_refuses_every_disagreement(found):
    cp = found["cp"]
    assert cp["model_cp_size"] == (1, 2)
    assert cp["loss_ok"] == "" and cp["cp_model_ok"] == ""
    # A model without CP fed CP shards (each shard would attend to itself alone).
    assert re.match(
        r"^cp_mode: the batch reaches the model sharded 2 ways", cp["model_on_unsharded"]
    )
    assert "context parallelism 1; it needs 2" in cp["model_on_unsharded"]
    # A CP model fed whole sequences; and forward_backward itself refuses it (the wiring).
    for key in ("cp_model_whole", "forward_backward"):
        assert re.match(r"^cp_mode: the batch reaches the model as whole sequences", cp[key])
        assert "context parallelism 2; it needs 1" in cp[key]
    # A model whose CP group and config disagree (megatron-core's default groups at CP=2 with
    # a CP-1 config: its rotary embedding would slice whole sequences by CP rank).
    assert cp["inconsistent"].startswith("chunks: the model's CP group has 2 ranks")


def _no_layer_index(name: str) -> str:
    # megatron-core's checkpoint keys stack the layers (the layer is a sharded offset).
    return re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.", name)


def test_local_spec_checkpoint_keys_are_the_converters_te_spelling(found):
    t = found["te_keys"]
    mcore = set(t["mcore_keys"])
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in mcore
    assert {_no_layer_index(n) for n in t["te_names"]} == mcore
    # Negative control: the local spelling is not what megatron-core's map says.
    assert {_no_layer_index(n) for n in t["local_names"]} != mcore


def test_grpo_update_keeps_every_tensor_on_ctx_device(found):
    d = found["device"]
    assert d["applied"] == 1
    assert d["seen"] == [d["ctx"]], d
    assert d["control_seen"] == ["meta"]  # the recorder sees a tensor on another device


def test_bf16_chunks_wrap_float16module_and_keep_names_and_a_close_loss(found):
    b = found["bf16"]
    assert b["wrapper"] == "Float16Module" and b["names_equal"]
    assert b["dtypes"] == ["torch.bfloat16"] and b["weights_are_rounded_init"]
    # DDP's main gradients stay fp32 (grad_reduce_in_fp32) for the fp32 main weights.
    assert b["grad_dtypes"] == ["torch.float32"] and b["grads_finite"]
    assert b["loss"] == pytest.approx(b["loss_fp32"], rel=0.05)
    assert b["loss"] != b["loss_fp32"]  # it really ran in bf16
