"""The world helpers of parallel/collectives.py: lifecycle, barrier and picklable objects.

    python -m pytest tests/test_collectives_world.py        # ~10 s: one launch of 2 gloo ranks

Alone (no process group) every helper is the identity of a world of one; on 2 gloo processes
started by parallel.world.spawn, an object broadcast from rank `src` replaces the other ranks'
(each rank passes a different one, so a helper that returned its input would be seen), and an
all-gather returns every rank's object in rank order.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_ba.parallel import collectives
from megatron_ba.parallel.world import free_port, spawn

# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


def test_world_of_one_without_a_process_group():
    assert not collectives.is_initialized()
    assert collectives.world_rank_and_size() == (0, 1)
    obj = {"a": [1, 2]}
    assert collectives.broadcast_object(obj) is obj
    assert collectives.all_gather_object(obj) == [obj]
    collectives.barrier()  # nothing to wait for
    collectives.destroy_process_group()  # nothing to leave: no error


def test_init_process_group_argument_errors():
    with pytest.raises(ValueError, match="rank and world_size together"):
        collectives.init_process_group("gloo", rank=0)
    with pytest.raises(ValueError, match="a port needs rank and world_size"):
        collectives.init_process_group("gloo", port=free_port())
    assert not collectives.is_initialized()


def test_free_port_is_bindable():
    import socket

    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nobody holds it


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    collectives.init_process_group("gloo", rank=rank, world_size=world, port=port)
    got = dict(
        rank_and_size=collectives.world_rank_and_size(),
        from_0=collectives.broadcast_object({"sent_by": rank}, src=0),
        from_1=collectives.broadcast_object(f"rank {rank}", src=1),
        gathered=collectives.all_gather_object(rank * 10),
        group_world=collectives.all_gather_object(rank, group=collectives.world_group()),
    )
    collectives.barrier()
    collectives.destroy_process_group()
    got["after_destroy"] = collectives.world_rank_and_size()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(got, f)


@pytest.mark.distributed
def test_objects_on_two_gloo_ranks(tmp_path):
    spawn(_worker, 2, (2, free_port(), str(tmp_path)))
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["rank_and_size"] == [rank, 2]
        assert got["from_0"] == {"sent_by": 0}
        assert got["from_1"] == "rank 1"
        assert got["gathered"] == [0, 10]
        assert got["group_world"] == [0, 1]
        assert got["after_destroy"] == [0, 1]
