"""The planner on pipeline stages that pp does not divide evenly, through `megatron-ba layout` as
users run it: Qwen3-235B-A22B's 94 layers at PP 4 (23, 24, 24, 23) and PP 8 (11, 12 x 6, 11),
megatron-core's most even splits (parallel_layout.balanced_stages), planned, never refused; a
pinned split used as given, or refused naming its flag; the no-layout message naming the rule
that refused; the remedies' PP x2 re-split."""

from __future__ import annotations

import json

import pytest

from megatron_ba.cli import main as cli_main
from megatron_ba.parallel.parallel_layout import ParallelLayout, balanced_stages
from megatron_ba.planning.cluster_layout import candidate_layouts
from megatron_ba.planning.memory import MemorySettings, VLLMShare, load_model
from megatron_ba.planning.verdict import assess, remedies

# A public-scale setup for the model: 8 nodes x 8 GPUs, EP 8, 8,192-token sequences, the
# colocated vLLM engine across a node (H200) or two (H100: 0.6 of 79 GiB cannot hold a
# 235B model's weights on 8 GPUs).
QWEN3_235B = ["layout", "--model", "Qwen3-235B-A22B", "--nodes", "8", "--gpus-per-node", "8",
              "--ep", "8", "--seq-len", "8192"]  # fmt: skip
SPLITS = {4: [23, 24, 24, 23], 8: [11, 12, 12, 12, 12, 12, 12, 11]}


def _layout(capsys, *args) -> tuple[int, dict | None, str]:
    status = cli_main([*QWEN3_235B, *args])
    out = capsys.readouterr()
    return status, (json.loads(out.out) if out.out.strip() else None), out.err


@pytest.mark.parametrize("pp", [4, 8])
def test_qwen3_235b_is_planned_at_pp4_and_pp8_with_megatron_cores_split(pp, capsys):
    status, j, err = _layout(capsys, "--gpu", "H200", "--vllm-tp", "8", "--pp", str(pp), "--json")
    assert status == 0 and j["fits"], err
    first, last = SPLITS[pp][0], SPLITS[pp][-1]
    assert (j["pp"], j["stage_layers"]) == (pp, SPLITS[pp])
    assert (j["pp_first_stage_layers"], j["pp_last_stage_layers"]) == (first, last)
    assert {f"parallel.pp={pp}", f"parallel.pp_first_stage_layers={first}",
            f"parallel.pp_last_stage_layers={last}"} <= set(j["overrides"])  # fmt: skip
    assert j["memory_gib_per_gpu"] <= j["gpu_mem_gib"]
    # the text shows the split
    assert cli_main([*QWEN3_235B, "--gpu", "H200", "--vllm-tp", "8", "--pp", str(pp)]) == 0
    assert f"pp={pp} (stage layers {','.join(map(str, SPLITS[pp]))})" in capsys.readouterr().out


def test_qwen3_235b_on_h100_pp8_fits_and_pp4_is_a_stated_out_of_memory(capsys):
    """On 8 x 8 H100 PP 8 fits; PP 4 is estimated (its split in the JSON) and does not fit:
    exit 1 with the reason, never a refusal of the layout."""
    status, j, err = _layout(capsys, "--gpu", "H100", "--vllm-tp", "16", "--pp", "8", "--json")
    assert status == 0 and j["fits"] and j["stage_layers"] == SPLITS[8], err
    status, j, err = _layout(capsys, "--gpu", "H100", "--vllm-tp", "16", "--pp", "4", "--json")
    assert status == 1 and j["fits"] is False and j["stage_layers"] == SPLITS[4]
    assert "more than the GPU holds" in j["why_not"] and "does not fit" in err


def test_the_search_proposes_pp_that_does_not_divide_the_layers():
    """Without --pp the candidates include the powers of two that do not divide 94 layers, each
    split as balanced_stages splits it (the divisors alone, 1, 2, 47 and 94, leave 64 GPUs at
    EP 8 only PP 1 and 2); each refusal of the rest is recorded by rule."""
    shape = load_model("Qwen3-235B-A22B")
    refused = {}
    candidates = candidate_layouts(shape, 64, 8, 8192, {"ep": 8}, refused)
    found = {lo.pp: lo.stage_layers(94) for lo in candidates}
    assert set(found) == {1, 2, 4, 8}
    assert list(found[4]) == SPLITS[4] and list(found[8]) == SPLITS[8] and found[2] == (47, 47)
    # PP 47 and 94 do not divide the 64 GPUs; from PP 16 a stage has fewer than EP 8's ranks
    assert "does not divide the 64 GPUs" in refused["world"] and refused["ep"].startswith("--ep:")


def test_a_pinned_split_is_used_as_given_or_refused_by_its_flag(capsys):
    base = ["--gpu", "H200", "--vllm-tp", "8", "--pp", "4", "--json"]
    status, j, err = _layout(capsys, *base, "--pp-first-stage-layers", "22")
    assert status == 0 and j["stage_layers"] == [22, 24, 24, 24], err
    assert "parallel.pp_first_stage_layers=22" in j["overrides"]
    assert not any(o.startswith("parallel.pp_last_stage_layers") for o in j["overrides"])
    for bad, flag in (
        (["--pp-first-stage-layers", "50"], "--pp-first-stage-layers: num_layers=94 less 50"),
        (["--pp-first-stage-layers", "23", "--pp-last-stage-layers", "30"],
         "--pp-last-stage-layers: num_layers=94 less 23"),
        (["--pp-last-stage-layers", "0"], "--pp-last-stage-layers: must be >= 1"),
    ):  # fmt: skip
        status, j, err = _layout(capsys, *base, *bad)
        assert (status, j) == (2, None) and flag in err, (bad, err)
    status, _, err = _layout(capsys, "--gpu", "H200", "--pp-first-stage-layers", "23")
    assert status == 2 and "--pp-first-stage-layers: needs --pp" in err
    status, _, err = _layout(capsys, "--gpu", "H200", "--pp", "128")
    assert status == 2 and "--pp: 128 stages are more than the num_layers=94" in err


def test_no_layout_names_the_rule_that_refused(capsys):
    """The pinned pp does not divide one node's 8 GPUs, and a pinned tp larger than the node:
    the message names what refused the candidates, not the heads."""
    status, _, err = _layout(capsys, "--gpu", "H200", "--pp", "16", "--nodes", "1")
    assert status == 1 and "tp*pp*cp = 1*16*1 does not divide the 8 GPUs" in err
    assert "KV heads" not in err
    args = ["layout", "--model", "Qwen3-1.7B", "--nodes", "1", "--gpus-per-node", "4", "--gpu",
            "H100", "--seq-len", "8192", "--tp", "8"]  # fmt: skip
    assert cli_main(args) == 1
    assert "--tp: 8 does not divide the 4 GPUs of a node" in capsys.readouterr().err


def test_remedies_double_pp_with_a_balanced_split():
    """PP x2 of an uneven layout re-splits the layers (PP 4's 23, 24, 24, 23 to PP 8's 11, 12,
    ..., 11), in the estimate and in the recipe keys it names."""
    shape = load_model("Qwen3-235B-A22B")
    lo = ParallelLayout(tp=4, pp=4, dp=4, ep=8, etp=1, sequence_parallel=True,
                        **balanced_stages(94, 4))  # fmt: skip
    step, vllm = MemorySettings(8192, recompute="full"), VLLMShare(0.6, tp=16)
    kw = dict(gpu_mem_gib=79.11, vllm=vllm, seq_len=8192)
    assert not assess(shape, lo, step, **kw).fits
    fixes = remedies(shape, lo, step, **kw, gpus_per_node=8)
    key = "parallel.pp=8 parallel.pp_first_stage_layers=11 parallel.pp_last_stage_layers=11"
    pp8 = ParallelLayout(tp=4, pp=8, dp=2, ep=8, etp=1, sequence_parallel=True,
                         **balanced_stages(94, 8))  # fmt: skip
    assert fixes == [("--pp 8", key, round(assess(shape, pp8, step, **kw).estimate.total_gib, 1))]
