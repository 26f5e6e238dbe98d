"""ParallelLayout (megatron_ba.parallel.parallel_layout): every rule of a layout, once, by hand.

    python -m pytest tests/test_layout_type.py -q        # < 1 s, pure Python

The rules against hand-made cases (each refusal names its field, and each has an accepted twin
that differs in the one value), the names users see (a recipe's keys, the commands' flags), the
world's dp, and the checkpoint record: written and read as the type, and the records earlier
versions wrote (a dense run's without ep and etp, an expert-parallel run's with them) read back.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_ba.model_shape import PRESETS
from megatron_ba.parallel.parallel_layout import FLAGS, RECIPE_KEYS, LayoutError, ParallelLayout

MOE = PRESETS["tiny-moe"]  # 8 experts, moe_ffn 64, 4 heads, 2 KV heads, 2 layers
DENSE = PRESETS["tiny"]


@pytest.mark.parametrize(
    ("fields", "key", "twin"),
    [
        (dict(tp=0), "tp", dict(tp=1)),
        (dict(dp=0), "dp", dict(dp=1)),
        (dict(etp=0), "etp", dict(etp=None)),
        (dict(tp=True), "tp", dict(tp=1)),  # a bool is no size
        (dict(sequence_parallel=True), "sequence_parallel", dict(tp=2, sequence_parallel=True)),
        (dict(sequence_parallel="yes"), "sequence_parallel", dict(sequence_parallel=False)),
        # etp x ep must divide the tp x cp x dp ranks of a stage
        (dict(dp=2, ep=4), "ep", dict(dp=4, ep=4)),
        (dict(dp=4, ep=2, etp=4), "etp", dict(dp=4, ep=2, etp=2)),  # ep alone would divide
        (dict(tp=2, dp=1, ep=2), "ep", dict(tp=2, dp=1, ep=2, etp=1)),  # etp None means tp
    ],
)
def test_each_rule_refuses_by_field_and_its_twin_is_accepted(fields, key, twin):
    with pytest.raises(LayoutError) as e:
        ParallelLayout(**fields)
    assert e.value.key == key
    ParallelLayout(**twin)


def test_model_rules_name_the_field():
    cases = [
        (ParallelLayout(tp=3), DENSE, "tp", "num_attention_heads=4 is not a multiple of tp=3"),
        (ParallelLayout(pp=3), DENSE, "pp", "num_layers=2 is not a multiple of pp=3"),
        (ParallelLayout(dp=2, ep=2), DENSE, "ep", "this one is dense"),
        (ParallelLayout(etp=1), DENSE, "etp", "this one is dense"),
        (ParallelLayout(dp=3, ep=3), MOE, "ep", "3 does not divide the 8 experts"),
        (ParallelLayout(dp=6, ep=2, etp=3), MOE, "etp", "3 does not divide moe_ffn_hidden_size"),
    ]
    for layout, model, key, message in cases:
        with pytest.raises(LayoutError, match=message) as e:
            layout.check_model(model)
        assert e.value.key == key
    # the twins: one value changed
    ParallelLayout(tp=2).check_model(DENSE)
    ParallelLayout(pp=2).check_model(DENSE)
    ParallelLayout(dp=4, ep=2).check_model(MOE)
    ParallelLayout(dp=4, ep=2, etp=2).check_model(MOE)


def test_tp_may_be_a_multiple_of_the_kv_heads_as_megatron_core_allows():
    """Qwen2.5-Math-7B's 4 KV heads: tp 8 (a multiple: each rank gathers one KV head, checked
    exactly by tests/test_layout_matrix.py's TP4 on the debug model's 2) is a layout, tp 3
    (neither) is refused naming tp."""
    q7 = PRESETS["Qwen2.5-Math-7B"]  # 28 heads, 4 KV heads
    ParallelLayout(tp=4).check_model(q7)
    ParallelLayout(tp=8).check_model(
        dataclasses.replace(q7, num_attention_heads=32, kv_channels=128)
    )
    with pytest.raises(LayoutError, match=r"num_query_groups=4 is not a multiple of tp=3 \(nor a"):
        ParallelLayout(tp=3).check_model(
            dataclasses.replace(q7, num_attention_heads=24, kv_channels=128)
        )


def test_pipeline_stages_even_or_split_as_megatron_core_splits_them():
    q7 = PRESETS["Qwen2.5-Math-7B"]  # 28 layers
    with pytest.raises(LayoutError, match="not a multiple of pp=3") as e:
        ParallelLayout(pp=3).check_model(q7)
    assert e.value.key == "pp"
    with pytest.raises(LayoutError, match=r"leaves 27 layer.* for the 28 other stage"):
        ParallelLayout(pp=29, pp_first_stage_layers=1).check_model(q7)
    assert ParallelLayout(pp=4).stage_layers(28) == (7, 7, 7, 7)
    # uneven: the given stages, the rest shared evenly by the stages between (hand-counted)
    assert ParallelLayout(pp=2, pp_first_stage_layers=2).stage_layers(5) == (2, 3)
    assert ParallelLayout(pp=2, pp_last_stage_layers=2).stage_layers(5) == (3, 2)
    assert ParallelLayout(pp=3, pp_first_stage_layers=1, pp_last_stage_layers=1).stage_layers(
        4
    ) == (1, 2, 1)
    split = ParallelLayout(pp=4, pp_first_stage_layers=23, pp_last_stage_layers=23)
    assert split.stage_layers(94) == (23, 24, 24, 23)  # Qwen3-235B-A22B's 94 layers
    assert [split.layer_offset(94, s) for s in range(4)] == [0, 23, 47, 71]
    ParallelLayout(pp=3, pp_first_stage_layers=10).check_model(q7)  # 10 + 9 + 9
    bad = [
        (dict(pp=3, pp_first_stage_layers=2), 5, "pp_first_stage_layers", "leaves 3 layer"),
        (dict(pp=2, pp_first_stage_layers=5), 5, "pp_first_stage_layers", "leaves 0 layer"),
        (dict(pp=2, pp_first_stage_layers=2, pp_last_stage_layers=2), 5, "pp_last_stage_layers",
         "are not the model's num_layers=5"),
    ]  # fmt: skip
    for fields, layers, key, words in bad:
        with pytest.raises(LayoutError, match=words) as e:
            ParallelLayout(**fields).stage_layers(layers)
        assert e.value.key == key
    for key in ("pp_first_stage_layers", "pp_last_stage_layers"):
        with pytest.raises(LayoutError, match="needs pp >= 2") as e:
            ParallelLayout(**{key: 1})
        assert e.value.key == key
        with pytest.raises(LayoutError, match="integer >= 1") as e:
            ParallelLayout(pp=2, **{key: 0})
        assert e.value.key == key


def test_balanced_stages_split_as_evenly_as_megatron_core_allows():
    from megatron_ba.parallel.parallel_layout import balanced_stages

    splits = {  # (layers, pp): stage layers, hand-counted
        (28, 4): (7, 7, 7, 7),
        (5, 2): (2, 3),
        (94, 4): (23, 24, 24, 23),
        (94, 8): (11, 12, 12, 12, 12, 12, 12, 11),
        (10, 4): (2, 3, 3, 2),
        (7, 4): (1, 2, 2, 2),
        (5, 3): (1, 2, 2),
        (3, 3): (1, 1, 1),
    }
    for (layers, pp), stages in splits.items():
        layout = ParallelLayout(pp=pp, **balanced_stages(layers, pp))
        assert layout.stage_layers(layers) == stages, (layers, pp)
    with pytest.raises(LayoutError, match="4 stages are more than the num_layers=3"):
        balanced_stages(3, 4)


def test_uneven_stages_round_trip_through_the_record():
    layout = ParallelLayout(pp=3, dp=2, pp_first_stage_layers=1, pp_last_stage_layers=1)
    assert layout.to_dict() == {
        **dict(tp=1, pp=3, cp=1, dp=2),
        **dict(pp_first_stage_layers=1, pp_last_stage_layers=1),
    }
    assert ParallelLayout.from_dict(layout.to_dict()) == layout
    assert "pp_first_stage_layers" not in ParallelLayout(pp=3, dp=2).to_dict()
    assert str(layout) == "TP1xPP3(first 1, last 1)xCP1xDP2"


def test_training_needs_sequence_parallelism_for_experts_at_tp():
    layout = ParallelLayout(tp=2, dp=2, ep=2)
    layout.check_model(MOE)  # converting or evaluating it is fine
    with pytest.raises(LayoutError, match="needs sequence parallelism") as e:
        layout.check_training(MOE)
    assert e.value.key == "tp"
    ParallelLayout(tp=2, dp=2, ep=2, sequence_parallel=True).check_training(MOE)
    ParallelLayout(tp=2).check_training(DENSE)  # a dense model trains without it


def test_unknown_sizes_are_not_checked():
    """A recipe's fresh model before its tokenizer exists: no vocabulary yet."""
    fresh = types.SimpleNamespace(num_attention_heads=4, num_query_groups=2, num_layers=2)
    ParallelLayout(tp=2).check_model(fresh)
    with pytest.raises(LayoutError):
        ParallelLayout(tp=2).check_model(types.SimpleNamespace(**vars(fresh), vocab_size=321))


def test_names_users_see():
    with pytest.raises(LayoutError) as e:
        ParallelLayout(dp=2, ep=4)
    assert e.value.renamed(RECIPE_KEYS).startswith("parallel.ep: etp*ep = 4 does not divide")
    assert e.value.renamed(FLAGS).startswith("--ep: etp*ep = 4 does not divide")
    with pytest.raises(LayoutError) as e:
        ParallelLayout(sequence_parallel=True)
    assert e.value.renamed(FLAGS).startswith("--sequence-parallel: needs tp > 1")
    with pytest.raises(LayoutError) as e:
        ParallelLayout(ep=2, dp=2).check_micro_batching(token_budget=True)
    assert e.value.renamed(RECIPE_KEYS).startswith("parallel.max_tokens_per_microbatch:")
    assert e.value.renamed(FLAGS).startswith("--token-budget:")
    ParallelLayout(ep=2, dp=2).check_micro_batching(token_budget=False)


def test_the_world_decides_dp():
    layout = ParallelLayout(tp=2, pp=2, dp=None)
    assert layout.for_world(8) == ParallelLayout(tp=2, pp=2, dp=2)
    with pytest.raises(LayoutError, match="world size 6 is not a multiple of tp\\*pp\\*cp") as e:
        layout.for_world(6)
    assert e.value.key == "world" and e.value.renamed(RECIPE_KEYS).startswith("parallel: ")
    with pytest.raises(LayoutError, match="leaves dp = 2") as e:
        ParallelLayout(tp=2, pp=2, dp=4).for_world(8)
    # expert parallelism waits for the world: ep 2 needs dp 2 here
    experts = ParallelLayout(ep=2, dp=None)
    assert experts.for_world(2).expert_dp == 1
    with pytest.raises(LayoutError) as e:
        experts.for_world(1)
    assert e.value.key == "ep"
    with pytest.raises(ValueError, match="unknown until the world size is"):
        _ = experts.world


def test_sizes():
    layout = ParallelLayout(tp=2, pp=2, cp=2, dp=4, ep=4, etp=1, sequence_parallel=True)
    assert (layout.world, layout.model_parallel, layout.stage_ranks) == (32, 8, 16)
    assert (layout.expert_tp, layout.expert_dp) == (1, 4)
    assert ParallelLayout(tp=4, dp=2, ep=2).expert_tp == 4  # megatron-core's default: tp
    assert str(layout) == "TP2+SPxPP2xCP2xDP4 EP4 ETP1"


def test_checkpoint_records_old_and_new():
    # what a dense run wrote before expert parallelism existed, and reads back equal
    dense = {"tp": 2, "pp": 1, "cp": 1, "dp": 2}
    assert ParallelLayout.from_dict(dense) == ParallelLayout(tp=2, dp=2)
    assert ParallelLayout(tp=2, dp=2).to_dict() == dense
    # what an expert-parallel run wrote (ep with etp null)
    moe = {"tp": 1, "pp": 1, "cp": 1, "dp": 2, "ep": 2, "etp": None}
    assert ParallelLayout.from_dict(moe).to_dict() == moe
    sp = ParallelLayout(tp=2, dp=1, sequence_parallel=True)
    assert ParallelLayout.from_dict(sp.to_dict()) == sp
    with pytest.raises(LayoutError, match="not a layout field") as e:
        ParallelLayout.from_dict({**dense, "vpp": 2})
    assert e.value.key == "vpp"


@given(
    st.integers(1, 4), st.integers(1, 3), st.integers(1, 2), st.integers(1, 8),
    st.integers(1, 4), st.sampled_from([None, 1, 2]), st.booleans(),
)  # fmt: skip
def test_a_built_layout_holds_every_rule_and_reads_back(tp, pp, cp, dp, ep, etp, sp):
    try:
        layout = ParallelLayout(tp, pp, cp, dp, ep, etp, sp)
    except LayoutError:
        ok = not (sp and tp < 2) and (tp * cp * dp) % ((etp or tp) * ep) == 0
        assert not ok
        return
    assert not (sp and tp < 2)
    assert layout.stage_ranks % (layout.expert_tp * layout.ep) == 0
    assert layout.world == tp * pp * cp * dp
    assert ParallelLayout.from_dict(layout.to_dict()) == layout
