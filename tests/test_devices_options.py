"""Precision, layer spec, SP and recompute options; the optimiser choice; TE names; devices.

Everything here runs without CUDA and without Transformer Engine: the CUDA path's objects
(megatron-core's OptimizerConfig, DistributedDataParallelConfig, OptimizerParamScheduler) are
built and checked field by field; `get_megatron_optimizer` itself needs CUDA and is not run.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_ba.megatron import optimizer_choice as mo
from megatron_ba.megatron.build_options import resolve_build_options
from megatron_ba.parallel.parallel_layout import LayoutError, ParallelLayout
from megatron_ba.recipe import RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[1]
CPU, GPU = torch.device("cpu"), torch.device("cuda", 1)  # a device object needs no GPU
OPT = SimpleNamespace(
    lr=1e-3, weight_decay=0.0, beta1=0.9, beta2=0.99, eps=1e-8, grad_clip=1.0, warmup_steps=3
)


# --- the optimiser by device and precision --------------------------------------------------


# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


def test_optimizer_choice_by_device_and_precision():
    assert mo.choose_optimizer(CPU, "fp32") == mo.SHARDED_ADAMW
    assert mo.choose_optimizer(GPU, "fp32") == mo.MEGATRON_CORE
    assert mo.choose_optimizer(GPU, "bf16") == mo.MEGATRON_CORE
    with pytest.raises(ValueError, match=r"^model\.precision: bf16 needs CUDA .* device is cpu"):
        mo.choose_optimizer(CPU, "bf16")
    with pytest.raises(ValueError, match=r"^model\.precision: must be one of fp32, bf16"):
        mo.choose_optimizer(GPU, "fp16")


def test_bf16_optimizer_config_is_distributed_mixed_precision_adam():
    pytest.importorskip("megatron.core")
    c = mo.optimizer_config(OPT, precision="bf16")
    assert (c.optimizer, c.bf16, c.fp16, c.use_distributed_optimizer) == ("adam", True, False, True)
    assert (c.params_dtype, c.main_params_dtype, c.main_grads_dtype) == (
        torch.bfloat16,
        torch.float32,
        torch.float32,
    )
    assert (c.lr, c.min_lr, c.weight_decay) == (1e-3, 1e-3, 0.0)
    assert (c.adam_beta1, c.adam_beta2, c.adam_eps, c.clip_grad) == (0.9, 0.99, 1e-8, 1.0)
    fp32 = mo.optimizer_config(OPT, precision="fp32")
    assert (fp32.bf16, fp32.use_distributed_optimizer, fp32.params_dtype) == (
        False,
        True,
        torch.float32,
    )
    # grad_clip 0 (off): an infinite threshold, so that the norm is still computed.
    off = mo.optimizer_config(SimpleNamespace(**{**vars(OPT), "grad_clip": 0.0}), precision="bf16")
    assert off.clip_grad == math.inf


def test_bf16_ddp_config_lays_buffers_out_for_the_distributed_optimizer():
    pytest.importorskip("megatron.core")
    from megatron.core.distributed import DistributedDataParallelConfig

    base = dict(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    bf16 = DistributedDataParallelConfig(**{**base, **mo.ddp_overrides("bf16", GPU)})
    assert bf16.use_distributed_optimizer and bf16.grad_reduce_in_fp32
    assert mo.ddp_overrides("fp32", GPU) == mo.ddp_overrides("bf16", GPU)
    assert mo.ddp_overrides("fp32", CPU) == {}


@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_megatron_scheduler_warms_up_as_the_cpu_schedule(warmup):
    pytest.importorskip("megatron.core")
    opt = SimpleNamespace(**{**vars(OPT), "warmup_steps": warmup})
    torch_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    sched = mo.param_scheduler(torch_opt, opt)
    for step in range(6):
        mo.set_scheduler_step(sched, step)
        # The CPU schedule, by hand: (step + 1) / warmup of the peak, then the peak.
        want = opt.lr * min(1.0, (step + 1) / warmup) if warmup else opt.lr
        assert torch_opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12), step
        plain = SimpleNamespace(lr=None)  # an optimiser without set_step (ShardedAdamW's case)
        mo.apply_lr_schedule(plain, step, lr=opt.lr, warmup_steps=opt.warmup_steps)
        assert plain.lr == pytest.approx(want, rel=1e-12), step
    # Negative control: without the +1 the first step would have lr 0 when warming up.
    if warmup > 1:
        sched.num_steps = 0
        sched.step(0)
        assert torch_opt.param_groups[0]["lr"] == 0.0


# --- layer spec, sequence parallelism, recomputation, CP -----------------------------------


def test_auto_layer_spec_picks_te_only_where_it_runs():
    r = resolve_build_options
    assert r(device=GPU, te_imports=True).transformer_impl == "transformer_engine"
    assert r(device=GPU, te_imports=False).transformer_impl == "local"
    assert r(device=CPU, te_imports=True).transformer_impl == "local"
    assert r(device=CPU, transformer_impl="local").transformer_impl == "local"
    with pytest.raises(ValueError, match=r"^model\.transformer_impl: transformer_engine, but"):
        r(device=GPU, transformer_impl="transformer_engine", te_imports=False)
    with pytest.raises(
        ValueError, match=r"^model\.transformer_impl: transformer_engine needs CUDA"
    ):
        r(device=CPU, transformer_impl="transformer_engine", te_imports=True)
    with pytest.raises(ValueError, match=r"^model\.transformer_impl: must be one of"):
        r(device=CPU, transformer_impl="te")


def test_attention_auto_is_sdpa_on_gpu_unfused_on_cpu_and_te_with_te():
    r = resolve_build_options
    assert r(device=CPU).attention == "unfused"  # the CPU suite's numerics, unchanged
    assert r(device=GPU, te_imports=False).attention == "sdpa"  # local spec on a GPU
    assert r(device=GPU, te_imports=True).attention == "transformer_engine"
    assert r(device=CPU, attention="sdpa").attention == "sdpa"
    assert r(device=GPU, te_imports=False, attention="unfused").attention == "unfused"
    assert r(device=GPU, te_imports=True, transformer_impl="local").attention == "sdpa"
    with pytest.raises(ValueError, match=r"^model\.attention: must be one of auto, sdpa, unfused"):
        r(device=CPU, attention="flash")
    for choice in ("sdpa", "unfused"):
        with pytest.raises(ValueError, match=rf"^model\.attention: {choice} chooses the local"):
            r(device=GPU, te_imports=True, attention=choice)


def test_attention_choice_reaches_the_layer_spec():
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_ba.megatron.model import tiny_qwen2_spec
    from megatron_ba.megatron.sdpa_attention import SDPAttention

    spec = tiny_qwen2_spec()
    for attention, core in (("sdpa", SDPAttention), ("unfused", DotProductAttention)):
        layer = resolve_build_options(device=CPU, attention=attention).layer_spec(spec)
        assert layer.submodules.self_attention.submodules.core_attention is core


def test_sequence_parallel_needs_tp_and_transformer_engine_on_cuda():
    r = resolve_build_options
    sp = ParallelLayout(tp=2, sequence_parallel=True)
    ok = r(device=GPU, layout=sp, te_imports=True)
    assert ok.config_fields()["sequence_parallel"] is True
    # the layout itself refuses SP without TP, under the name its users give it
    with pytest.raises(LayoutError, match=r"^sequence_parallel: needs tp > 1"):
        ParallelLayout(tp=1, sequence_parallel=True)
    with pytest.raises(RecipeError, match=r"^parallel\.sequence_parallel: needs tp > 1"):
        load_recipe(ROOT / "recipes/tiny-cpu.yaml", ["parallel.sequence_parallel=true"])
    # megatron-core's local spec refuses SP (WrappedTorchNorm asserts not sequence_parallel);
    # only CPU runs shim its norms (cpu_compat shim 6).
    with pytest.raises(ValueError, match=r"^parallel\.sequence_parallel: needs the Transformer"):
        r(device=GPU, layout=sp, transformer_impl="local", te_imports=True)
    cpu = r(device=CPU, layout=sp)
    assert cpu.transformer_impl == "local" and cpu.config_fields()["sequence_parallel"] is True


def test_recompute_and_precision_config_fields():
    r = resolve_build_options
    full = r(device=CPU, recompute="full").config_fields()
    assert (full["recompute_granularity"], full["recompute_method"]) == ("full", "uniform")
    assert full["recompute_num_layers"] == 1
    sel = r(device=CPU, recompute="selective").config_fields()
    assert sel["recompute_granularity"] == "selective" and "recompute_method" not in sel
    assert "recompute_granularity" not in r(device=CPU).config_fields()
    with pytest.raises(ValueError, match=r"^parallel\.recompute: must be one of"):
        r(device=CPU, recompute="some")
    bf16 = r(device=GPU, precision="bf16", te_imports=False).config_fields()
    assert (bf16["bf16"], bf16["params_dtype"], bf16["pipeline_dtype"]) == (
        True,
        torch.bfloat16,
        torch.bfloat16,
    )
    with pytest.raises(ValueError, match=r"^model\.precision: bf16 needs CUDA"):
        r(device=CPU, precision="bf16")


def test_context_parallelism_goes_into_te_models_only():
    te = resolve_build_options(device=GPU, layout=ParallelLayout(cp=4), te_imports=True)
    assert (te.model_cp, te.cp_mode, te.config_fields()["context_parallel_size"]) == (4, "model", 4)
    assert te.pg_collection() is None  # megatron-core's default groups: the real CP group
    local = resolve_build_options(device=CPU, layout=ParallelLayout(cp=4))
    assert (local.model_cp, local.cp_mode) == (1, "loss")
    assert local.config_fields()["context_parallel_size"] == 1


def test_recipe_keys_are_checked_by_name():
    tiny = ROOT / "recipes/tiny-cpu.yaml"
    r = load_recipe(tiny)
    assert (r.model.precision, r.model.transformer_impl, r.model.attention) == (
        "fp32",
        "auto",
        "auto",
    )
    assert (r.parallel.sequence_parallel, r.parallel.recompute) == (False, "none")
    for override, message in [
        ("model.precision=fp16", r"^model\.precision: must be fp32 or bf16"),
        ("model.transformer_impl=te", r"^model\.transformer_impl: must be auto"),
        ("model.attention=flash", r"^model\.attention: must be auto, sdpa or unfused"),
        ("parallel.recompute=most", r"^parallel\.recompute: must be none, selective or full"),
        ("parallel.sequence_parallel=true", r"^parallel\.sequence_parallel: needs tp > 1"),
    ]:
        with pytest.raises(RecipeError, match=message):
            load_recipe(tiny, [override])
    te = ["model.transformer_impl=transformer_engine"]
    assert load_recipe(tiny, te).model.attention == "auto"
    with pytest.raises(RecipeError, match=r"^model\.attention: chooses the local spec's core"):
        load_recipe(tiny, [*te, "model.attention=sdpa"])


# --- devices ------------------------------------------------------------------------------


def test_rank_device_is_local_rank_gpu_or_cpu(monkeypatch):
    from megatron_ba.parallel import world

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert world.rank_device(3) == CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert world.rank_device() == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"^LOCAL_RANK: 2 has no GPU on this node \(2 visible\)"):
        world.rank_device(2)


def test_experience_moves_every_tensor_to_the_device():
    from megatron_ba.generation.engine import Sample
    from megatron_ba.train.experience import build_experience

    samples = [[Sample([5, 6], "", True), Sample([7], "", False)]]
    exp = build_experience([[1, 2]], samples, [1.0, 0.0], pad_id=0)
    moved = exp.to(torch.device("meta"))  # any device other than the CPU will do
    tensors = {k: v for k, v in vars(moved).items() if isinstance(v, torch.Tensor)}
    assert len(tensors) == 7 and all(t.device.type == "meta" for t in tensors.values())
    assert moved.rows(1, 0).device.type == "meta"
    assert exp.device == CPU and moved.num_groups == exp.num_groups


# --- Transformer Engine parameter names --------------------------------------------------


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_hf_to_te_names_and_back_is_the_identity(family):
    from megatron_ba.conversion import hf_named_tensors
    from megatron_ba.conversion.megatron_io import megatron_state_dict_from_hf
    from megatron_ba.megatron import model as mm

    extra = dict(family="qwen3", qkv_bias=False, qk_layernorm=True) if family == "qwen3" else {}
    spec = mm.tiny_qwen2_spec(num_layers=2, **extra)
    hf = dict(hf_named_tensors(mm.full_init_state_dict(spec), spec))
    te = megatron_state_dict_from_hf(hf, spec, spelling="transformer_engine")
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in te
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in te)
    local = megatron_state_dict_from_hf(hf, spec)
    assert len(te) == len(local) == len(mm.full_parameter_shapes(spec))
    back = dict(hf_named_tensors(te, spec))
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    # Negative control: a misspelt TE name is refused, not dropped.
    te["decoder.layers.0.mlp.linear_fc1.layernorm_weight"] = te.pop(
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    )
    with pytest.raises(KeyError, match="layernorm_weight"):
        dict(hf_named_tensors(te, spec))


def test_a_moe_spec_gets_the_moe_block_spec_from_its_config():
    """A mixture-of-experts spec's layer spec follows its TransformerConfig (moe_layer_freq):
    without one it is refused by name. With one it is model.moe_layer_spec(config), which the
    MoE layout check (tests/test_moe_layout.py) and tests/test_moe_aux_loss.py build through."""
    from megatron_ba.megatron.model import ModelSpec
    from megatron_ba.model_shape import PRESETS

    spec = ModelSpec.of(PRESETS["tiny-moe"])
    with pytest.raises(ValueError, match=r"^config: a mixture-of-experts layer spec"):
        resolve_build_options(device=CPU).layer_spec(spec)
