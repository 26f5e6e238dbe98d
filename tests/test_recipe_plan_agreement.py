"""The Slurm launcher's fit check and `megatron-ba layout` agree on every shipped recipe.

    python -m pytest tests/test_recipe_plan_agreement.py -q      # ~10 s: no training, no launch

For each recipe the launcher (`python -m megatron_ba.planning.launch fit`, what
slurm/grpo_balanced.sh asks before it submits anything) and the planner's command line
(`megatron-ba layout --json`), given the same model, GPUs and the recipe's whole layout pinned by
flags, must return the same verdict and the same GiB per GPU. The cluster is the one the recipe's
header plans for (`# layout: megatron-ba layout ...`), or one node of the GPUs a CPU recipe's
layout needs; the model is Qwen3-30B-A3B's config.json as its release ships it
(tests/fixtures/hf_configs/), a config.json of the header's preset for the other paper recipes,
the tiny checkpoint `megatron-ba tiny-model` builds for tiny-hf-cpu, and the fresh model's shape
keys for the CPU recipes without a checkpoint. A Qwen3.5 preset's config.json is written in the
release's layout (its text model under text_config) and reads back as the preset.

The flagship mixture-of-experts recipe fits 4 x 8 GPUs of 80 GiB with its expert parallelism 8
and is refused at ep=1 (the control: the one property changed); a launcher that plans without the
recipe's expert parallelism is seen to disagree.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path

import pytest

from megatron_ba.cli import main as cli_main
from megatron_ba.model_shape import ModelShape
from megatron_ba.planning import launch
from megatron_ba.planning.generation_memory import ENGINE_PROCESS_GIB
from megatron_ba.planning.memory import load_model
from megatron_ba.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
QWEN3_30B_A3B = ROOT / "tests/fixtures/hf_configs/Qwen3-30B-A3B"
FLAGSHIP = ROOT / "recipes/qwen3-30b-a3b-dapo17k-16k.yaml"


def hf_config(shape: ModelShape, rope_scaling: dict | None = None) -> dict:
    """A config.json of `shape` with the keys the planner reads (checked to read back equal)."""
    cfg = {
        "model_type": shape.family,  # the families' names are their model types
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_query_groups,
        "intermediate_size": shape.ffn_hidden_size,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "rope_theta": shape.rope_theta,
        "rms_norm_eps": shape.norm_eps,
        "attention_bias": shape.qkv_bias,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "rope_scaling": rope_scaling,
    }
    if shape.kv_channels is not None:
        cfg["head_dim"] = shape.kv_channels
    if shape.is_moe:
        cfg |= {
            "num_experts": shape.num_experts,
            "num_experts_per_tok": shape.moe_router_topk,
            "moe_intermediate_size": shape.moe_ffn_hidden_size,
        }
    if shape.family.startswith("qwen3_5"):
        return _qwen3_5_config(shape, cfg)
    return cfg


def _qwen3_5_config(shape: ModelShape, cfg: dict) -> dict:
    """A Qwen3.5 config.json in its release layout (ConditionalGeneration: the text model under
    text_config) with the keys the planner reads."""
    text = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_theta")}
    text |= {
        "model_type": f"{shape.family}_text",
        "layer_types": [
            "linear_attention" if shape.is_linear_attention_layer(i) else "full_attention"
            for i in range(shape.num_layers)
        ],
        "linear_conv_kernel_dim": shape.linear_conv_kernel_dim,
        "linear_key_head_dim": shape.linear_key_head_dim,
        "linear_value_head_dim": shape.linear_value_head_dim,
        "linear_num_key_heads": shape.linear_num_key_heads,
        "linear_num_value_heads": shape.linear_num_value_heads,
        "attn_output_gate": shape.attention_output_gate,
        "rope_parameters": {
            "rope_theta": shape.rope_theta,
            "partial_rotary_factor": shape.rotary_percent,
        },
        "mtp_num_hidden_layers": shape.mtp_num_layers,
    }
    if shape.is_moe:
        text |= {
            "shared_expert_intermediate_size": shape.shared_expert_ffn_hidden_size,
            "norm_topk_prob": shape.moe_norm_topk_prob,
            "router_aux_loss_coef": shape.moe_aux_loss_coeff,
        }
    return {
        "model_type": shape.family,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "text_config": text,
    }


def header_flags(path: Path) -> dict[str, str] | None:
    """The flags of a recipe header's `# layout: megatron-ba layout ...` line (None: none)."""
    line = next((x for x in path.read_text().splitlines() if x.startswith("# layout: ")), None)
    if line is None:
        return None
    argv = shlex.split(line.removeprefix("# layout: megatron-ba layout "))
    return dict(zip(argv[::2], argv[1::2], strict=True))


def model_dir(path: Path, recipe, tmp: Path) -> tuple[list[str], Path]:
    """(recipe overrides pointing it at a readable model, a folder with the model's
    config.json) for `recipe`."""
    out = tmp / path.stem
    out.mkdir()
    flags = header_flags(path)
    if path == FLAGSHIP:
        return [f"model.pretrained={QWEN3_30B_A3B}"], QWEN3_30B_A3B
    if flags is not None:  # a paper recipe: the header's model
        rope = recipe.model.rope_scaling
        scaling = None
        if rope.type == "yarn":
            scaling = rope.settings().hf_fields()
        shape = load_model(flags["--model"])
        (out / "config.json").write_text(json.dumps(hf_config(shape, scaling)))
        if shape.family.startswith("qwen3_5"):  # the config reads back as the preset
            assert dataclasses.replace(load_model(str(out)), name=shape.name) == shape
        return [f"model.pretrained={out}"], out
    if recipe.model.pretrained:  # tiny-hf-cpu: the tiny checkpoint `megatron-ba tiny-model` builds
        from megatron_ba.testing.tiny_hf import build_tiny_qwen3

        build_tiny_qwen3(out)
        return [f"model.pretrained={out}"], out
    shape = launch.recipe_shape(recipe)  # a fresh model: the recipe's shape keys
    (out / "config.json").write_text(json.dumps(hf_config(shape)))
    # the config reads back as the same model (the router's loss coefficient is no size; the
    # Qwen3.5-MoE config keeps it, the Qwen3-MoE one not)
    no_aux = dict(moe_aux_loss_coeff=0.0)
    assert dataclasses.replace(load_model(str(out)), **no_aux) == dataclasses.replace(
        shape, **no_aux
    )
    return [], out


def cluster(recipe, path: Path) -> tuple[int, int, float]:
    """(nodes, GPUs per node, GiB per GPU): the header's, or one node of the recipe's layout."""
    flags = header_flags(path)
    if flags is not None:
        return int(flags["--nodes"]), int(flags["--gpus-per-node"]), float(flags["--gpu-mem"])
    layout = recipe.parallel.layout()
    return 1, layout.model_parallel * layout.ep, 80.0


def layout_flags(recipe, shape: ModelShape) -> list[str]:
    """`megatron-ba layout` flags pinning the recipe's layout and step settings."""
    p, g, r = recipe.parallel, recipe.grpo, recipe.rollout
    layout = p.layout()
    out = ["--tp", str(p.tp), "--pp", str(p.pp), "--cp", str(p.cp)]
    for key in ("pp_first_stage_layers", "pp_last_stage_layers"):  # a recipe's uneven stages
        if getattr(p, key) is not None:
            out += ["--" + key.replace("_", "-"), str(getattr(p, key))]
    if shape.is_moe:
        out += ["--ep", str(layout.ep), "--etp", str(layout.expert_tp)]
    if p.tp > 1 and not p.sequence_parallel:
        out.append("--no-sequence-parallel")
    out += ["--seq-len", str((recipe.data.max_prompt_tokens or 512) + g.max_new_tokens)]
    out += ["--micro-batch-size", str(p.micro_batch_size), "--recompute", p.recompute]
    util = r.gpu_memory_utilization if r.engine == "vllm" else 0
    out += ["--vllm-gpu-util", str(util), "--vllm-tp", str(r.engine_tp)]
    out += ["--refit-bucket-mb", str(r.refit_bucket_mb)]
    if r.in_process:
        out.append("--engine-in-process")
    if not r.sleep:
        out.append("--vllm-awake")
    # one optimiser step's sequences (the micro-batches 1F1B can hold in flight)
    out += ["--group-size", str(g.group_size)]
    out += ["--prompts-per-step", str(g.prompts_per_step // max(1, g.mini_batches))]
    if recipe.loss.kl_coef > 0:
        out.append("--reference")
    return out


def both_verdicts(path: Path, tmp: Path, capsys, extra: list[str] = ()) -> tuple[dict, dict]:
    """({"fits", "gib"} of the launcher, the same of `megatron-ba layout`) on `path`."""
    recipe = load_recipe(path, list(extra))
    overrides, folder = model_dir(path, recipe, tmp)
    nodes, gpus, mem = cluster(recipe, path)
    shape = load_model(str(folder))
    capsys.readouterr()
    fit = ["fit", str(path), *overrides, *extra, "--nodes", str(nodes), "--gpus-per-node",
           str(gpus), "--gpu-mem", str(mem)]  # fmt: skip
    status = launch.main(fit)
    out, err = capsys.readouterr()
    assert status in (0, launch.FIT_EXIT), err
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    gib = float(values["RECIPE_MEMORY_GIB"]) if status == 0 else _refused_gib(err)
    launcher = {"fits": status == 0, "gib": gib}
    cmd = ["layout", "--model-config", str(folder), "--nodes", str(nodes), "--gpus-per-node",
           str(gpus), "--gpu-mem", str(mem), *layout_flags(load_recipe(path, list(extra)), shape),
           "--json"]  # fmt: skip
    cli_main(cmd)
    planned = json.loads(capsys.readouterr().out)
    return launcher, {"fits": planned["fits"], "gib": planned["memory_gib_per_gpu"]}


def _refused_gib(err: str) -> float:
    """The GiB per GPU a refusal names ("... needs 217.3 GiB per GPU ...")."""
    return float(err.split("needs ", 1)[1].split(" GiB", 1)[0])


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_launcher_and_planner_agree_on_every_recipe(path, tmp_path, capsys):
    launcher, planner = both_verdicts(path, tmp_path, capsys)
    assert launcher["fits"] == planner["fits"], (launcher, planner)
    # the refusal's figure is printed to 0.1 GiB, RECIPE_MEMORY_GIB and the JSON to 0.01
    assert launcher["gib"] == pytest.approx(planner["gib"], abs=0.051), (launcher, planner)
    assert launcher["fits"], f"{path.name} does not fit the cluster it is sized for: {launcher}"


def test_the_flagship_moe_recipe_fits_with_its_experts_split_and_not_at_ep1(tmp_path, capsys):
    launcher, planner = both_verdicts(FLAGSHIP, tmp_path, capsys)
    # 70.94 GiB before the engine's own process (CUDA context, communicators) was counted:
    # its 3.205 GiB (generation_memory.ENGINE_PROCESS_GIB) come on top of the training peak
    # (72.02 before the experts' outputs, which megatron-core does not keep, left the count)
    gib = 70.94 + ENGINE_PROCESS_GIB
    assert launcher == {"fits": True, "gib": pytest.approx(gib, abs=0.01)}
    assert planner["fits"] and planner["gib"] == pytest.approx(gib, abs=0.01)
    # the control: the same recipe, layout and GPUs with every expert on each GPU
    one = tmp_path / "ep1"
    one.mkdir()
    launcher, planner = both_verdicts(FLAGSHIP, one, capsys, ["parallel.ep=1"])
    assert not launcher["fits"] and not planner["fits"]
    assert launcher["gib"] == pytest.approx(planner["gib"], abs=0.051) and launcher["gib"] > 200


def test_agreement_check_sees_a_launcher_that_drops_expert_parallelism(
    tmp_path, capsys, monkeypatch
):
    """The comparison can fail: a launcher that plans the recipe at ep=1 (every expert on each
    GPU) disagrees with the planner on the flagship recipe."""
    plan = launch.recipe_plan

    def without_experts(recipe, dp):
        layout, step, vllm, seq_len = plan(recipe, dp)
        return dataclasses.replace(layout, ep=1), step, vllm, seq_len

    monkeypatch.setattr(launch, "recipe_plan", without_experts)
    launcher, planner = both_verdicts(FLAGSHIP, tmp_path, capsys)
    assert launcher["fits"] != planner["fits"] and launcher["gib"] > 2.5 * planner["gib"]


def test_uneven_stages_agree_and_the_split_counts(tmp_path, capsys, monkeypatch):
    """A recipe's uneven stages (parallel.pp_first_stage_layers) reach both: the flagship at PP 2
    with 20 + 28 layers gives one verdict and GiB per GPU; the control, the planner given --pp
    alone (an even 24 + 24), differs from the launcher's figure."""
    uneven = ["parallel.pp=2", "parallel.pp_first_stage_layers=20"]
    launcher, planner = both_verdicts(FLAGSHIP, tmp_path, capsys, uneven)
    assert launcher["gib"] == pytest.approx(planner["gib"], abs=0.051), (launcher, planner)
    assert launcher["fits"] == planner["fits"]
    flags = layout_flags

    def without_split(recipe, shape):
        out = flags(recipe, shape)
        i = out.index("--pp-first-stage-layers")
        return out[:i] + out[i + 2 :]

    monkeypatch.setattr(sys.modules[__name__], "layout_flags", without_split)
    even = tmp_path / "even"
    even.mkdir()
    launcher, planner = both_verdicts(FLAGSHIP, even, capsys, uneven)
    assert abs(launcher["gib"] - planner["gib"]) > 0.5, (launcher, planner)
