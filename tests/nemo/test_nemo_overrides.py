"""Recipe -> NeMo-Aligner overrides (`--print-overrides`) and the shipped Hydra config.

The translation runs anywhere (no NeMo import); the Hydra composition test runs in .venv-nemo.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, needs_nemo

from megatron_ba.integrations.engines.nemo_aligner import recipe_to_nemo_overrides
from megatron_ba.recipe import RopeScalingSection, load_recipe

CONF = REPO / "megatron_ba/integrations/nemo_aligner/conf/gpt_grpo_balanced.yaml"
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
TINY = REPO / "recipes/tiny-cpu.yaml"


def _as_dict(overrides: list[str]) -> dict[str, str]:
    """The `++key=value` overrides as a dict (`~key` removals: _removed)."""
    kept = [o for o in overrides if not o.startswith("~")]
    assert all(o.startswith("++") and "=" in o for o in kept), overrides
    return dict(o[2:].split("=", 1) for o in kept)


def _removed(overrides: list[str]) -> list[str]:
    return [o[1:] for o in overrides if o.startswith("~")]


def _has_key(tree: dict, dotted: str) -> bool:
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_translates_to_keys_of_the_shipped_config(path):
    recipe = load_recipe(path)
    if recipe.parallel.ep != 1:  # the MoE recipes: expert parallelism is refused by name
        with pytest.raises(ValueError, match=r"^parallel\.ep: expert parallelism is the local"):
            recipe_to_nemo_overrides(recipe)
        return
    if recipe.model.pretrained and not recipe.model.pretrained.endswith(".nemo"):
        # A Hugging Face checkpoint: NeMo-Aligner needs it converted to .nemo first.
        with pytest.raises(ValueError, match=r"^model\.pretrained: NeMo-Aligner restores a .nemo"):
            recipe_to_nemo_overrides(recipe)
        recipe = load_recipe(path, [f"model.pretrained={recipe.model.pretrained}.nemo"])
        if recipe.model.rope_scaling.type is not None:  # the long-context recipes' YaRN
            with pytest.raises(ValueError, match=r"^model\.rope_scaling: the nemo_aligner"):
                recipe_to_nemo_overrides(recipe)
            recipe = load_recipe(path, [f"model.pretrained={recipe.model.pretrained}"])
            recipe = dataclasses.replace(
                recipe, model=dataclasses.replace(recipe.model, rope_scaling=RopeScalingSection())
            )
        got = _as_dict(recipe_to_nemo_overrides(recipe))
        assert got["pretrained_checkpoint.restore_from_path"].endswith(".nemo")
        return
    got = _as_dict(recipe_to_nemo_overrides(recipe))
    conf = yaml.safe_load(CONF.read_text())
    missing = [k for k in got if not _has_key(conf, k)]
    assert missing == [], f"overrides for keys absent from {CONF.name}: {missing}"
    assert got["model.tensor_model_parallel_size"] == str(recipe.parallel.tp)
    assert got["trainer.devices"] == str(recipe.parallel.tp * recipe.parallel.pp)
    assert got["model.grpo.rule"] == recipe.loss.rule
    assert got["pretrained_checkpoint.restore_from_path"] == "???"  # tiny recipes: no .nemo


def test_layout_nodes_checkpoint_and_batch_sizes():
    recipe = load_recipe(
        RECIPES[0],
        [
            "parallel.tp=2",
            "parallel.micro_batch_size=4",
            "model.pretrained=/ckpt/m.nemo",
            "warmstart.enabled=false",
            "tokenizer.kind=hf",
            "grpo.prompts_per_step=32",
            "grpo.group_size=8",
            "grpo.mini_batches=2",
        ],
    )
    got = _as_dict(recipe_to_nemo_overrides(recipe, num_nodes=2, devices=8))
    assert got["trainer.num_nodes"] == "2" and got["trainer.devices"] == "8"
    assert got["pretrained_checkpoint.restore_from_path"] == "/ckpt/m.nemo"
    assert got["model.global_batch_size"] == "128"  # 32 x 8 / 2 mini-batches
    assert got["model.reinforce.num_rollout_samples"] == "32"
    assert got["trainer.reinforce.num_rollouts_per_prompt"] == "8"


def test_what_does_not_carry_over_fails_with_the_key_named():
    recipe = load_recipe(RECIPES[0])
    bad = [
        (
            dataclasses.replace(recipe, parallel=dataclasses.replace(recipe.parallel, cp=2)),
            "parallel.cp",
        ),
        (
            dataclasses.replace(recipe, loss=dataclasses.replace(recipe.loss, entropy_coef=0.1)),
            "loss.entropy_coef",
        ),
        (
            dataclasses.replace(
                recipe, model=dataclasses.replace(recipe.model, pretrained="/hf/qwen")
            ),
            "model.pretrained",
        ),
    ]
    for r, key in bad:
        with pytest.raises(ValueError, match=key):
            recipe_to_nemo_overrides(r)
    with pytest.raises(ValueError, match=r"grpo\.prompts_per_step"):
        recipe_to_nemo_overrides(
            dataclasses.replace(recipe, parallel=dataclasses.replace(recipe.parallel, tp=2, pp=1)),
            num_nodes=1,
            devices=6,
        )


@needs_nemo
@pytest.mark.slow
def test_train_grpo_composes_the_config_with_overrides(tmp_path):
    """Hydra + NeMo's hydra_runner compose conf/gpt_grpo_balanced.yaml with `++` overrides."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_ba.integrations.nemo_aligner.train_grpo",
            "++model.grpo.rule=token",
            "++trainer.num_nodes=3",
            "--cfg",
            "job",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    cfg = yaml.safe_load(proc.stdout[proc.stdout.index("trainer:") :])
    assert cfg["trainer"]["num_nodes"] == 3 and cfg["model"]["grpo"]["rule"] == "token"


@needs_nemo
def test_check_layout_says_which_megatron_core_it_supports():
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ba.cli", "check-layout"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "megatron-core 0.10.0 is not supported" in proc.stderr and "0.16.1" in proc.stderr


def test_precision_recompute_and_sequence_parallel_carry_over():
    """The 32B recipe's bf16 / sequence parallelism / full recomputation become NeMo's keys;
    a tiny fp32 recipe without them gets NeMo's off values (a wrong mapping fails either)."""
    big = load_recipe(
        REPO / "recipes/qwen2.5-32b-dapo17k-16k.yaml", ["model.pretrained=/ckpt/q32.nemo"]
    )
    got = _as_dict(recipe_to_nemo_overrides(big, num_nodes=4, devices=8))
    assert got["trainer.precision"] == "bf16"
    assert got["model.sequence_parallel"] == "true"
    assert got["model.activations_checkpoint_granularity"] == "full"
    assert got["model.activations_checkpoint_method"] == "uniform"
    assert got["model.activations_checkpoint_num_layers"] == "1"
    tiny = _as_dict(recipe_to_nemo_overrides(load_recipe(TINY)))
    assert tiny["trainer.precision"] == "32"
    assert tiny["model.sequence_parallel"] == "false"
    assert tiny["model.activations_checkpoint_granularity"] == "null"
    selective = load_recipe(TINY, ["parallel.recompute=selective"])
    sel = _as_dict(recipe_to_nemo_overrides(selective))
    assert sel["model.activations_checkpoint_granularity"] == "selective"
    assert sel["model.activations_checkpoint_method"] == "null"


@pytest.mark.parametrize(
    "override", ["parallel.max_tokens_per_microbatch=4096", "parallel.logprob_chunk_size=512"]
)
def test_local_backend_only_keys_are_refused_by_name(override):
    recipe = load_recipe(TINY, [override])
    with pytest.raises(ValueError, match=override.split("=")[0].replace(".", r"\.")):
        recipe_to_nemo_overrides(recipe)


def test_cpu_runs_fp32_with_torchs_adamw_and_drop_apexs_keys():
    """accelerator=cpu: what a CPU run needs, all of it and only there (a GPU translation of the
    same recipe keeps the config's apex Adam)."""
    recipe = load_recipe(TINY)
    cpu = recipe_to_nemo_overrides(recipe, accelerator="cpu")
    gpu = recipe_to_nemo_overrides(recipe)
    got = _as_dict(cpu)
    assert got["trainer.accelerator"] == "cpu" and got["trainer.precision"] == "32"
    assert got["model.megatron_amp_O2"] == "false"  # fp32 weights: no O2 master copy
    assert got["model.optim.name"] == "adamw"
    assert got["model.reinforce.offload_adam_states"] == "false"
    conf = yaml.safe_load(CONF.read_text())
    assert _removed(cpu) == [f"model.optim.{k}" for k in ("bucket_cap_mb", "overlap_grad_sync",
                                                           "contiguous_grad_buffer")]  # fmt: skip
    assert all(_has_key(conf, k) for k in _removed(cpu))  # each names a key the config has
    assert _removed(gpu) == [] and "model.optim.name" not in _as_dict(gpu)
    assert _as_dict(gpu)["trainer.accelerator"] == "gpu"
    with pytest.raises(ValueError, match=r"^model\.precision: the nemo_aligner backend on CPU"):
        recipe_to_nemo_overrides(load_recipe(TINY, ["model.precision=bf16"]), accelerator="cpu")
    with pytest.raises(ValueError, match=r"^accelerator: must be gpu or cpu"):
        recipe_to_nemo_overrides(recipe, accelerator="tpu")


@pytest.mark.parametrize(
    ("every", "want"),
    [
        (["eval.every=10", "checkpoint.every=10"], ("10", "10")),
        (["eval.every=5", "checkpoint.every=10"], ("5", "10")),
        (["eval.every=0", "checkpoint.every=0"], ("40", "40")),  # 0: at the end, grpo.steps
        (["eval.every=5", "checkpoint.every=0"], ("5", "40")),
    ],
)
def test_eval_and_checkpoint_intervals(every, want):
    got = _as_dict(recipe_to_nemo_overrides(load_recipe(TINY, ["grpo.steps=40", *every])))
    assert (
        got["trainer.reinforce.val_check_interval"],
        got["trainer.reinforce.save_interval"],
    ) == want


@pytest.mark.parametrize("every", [["eval.every=4", "checkpoint.every=10"],
                                   ["eval.every=0", "checkpoint.every=10"]])  # fmt: skip
def test_a_checkpoint_interval_off_the_evaluation_steps_names_both_keys(every):
    with pytest.raises(ValueError, match=r"^checkpoint\.every: .* multiple of eval\.every"):
        recipe_to_nemo_overrides(load_recipe(TINY, ["grpo.steps=40", *every]))


def test_rollout_and_validation_batches_follow_the_dp_share():
    """Each DP rank generates all its prompts in one call and validates on its share."""
    recipe = load_recipe(TINY, ["data.eval_prompts=24"])  # 32 prompts, micro-batches of 64
    got = _as_dict(recipe_to_nemo_overrides(recipe, devices=2))  # TP1: DP 2
    assert got["model.reinforce.rollout_micro_batch_size"] == "16"
    assert got["model.reinforce.num_val_samples"] == "24"
    assert got["model.reinforce.val_rollout_micro_batch_size"] == "12"
    assert got["model.reinforce.forward_micro_batch_size"] == "64"
    with pytest.raises(ValueError, match=r"^data\.eval_prompts: 25 held-out prompts"):
        recipe_to_nemo_overrides(load_recipe(TINY, ["data.eval_prompts=25"]), devices=2)


def test_prompt_files_and_log_folder():
    got = _as_dict(
        recipe_to_nemo_overrides(
            load_recipe(TINY), prompt_files=("d/train.jsonl", "d/val.jsonl"), log_dir="runs/r"
        )
    )
    assert got["model.data.data_prefix.train"] == "d/train.jsonl"
    assert got["model.data.data_prefix.validation"] == "d/val.jsonl"
    assert got["exp_manager.explicit_log_dir"] == "runs/r"
    bare = _as_dict(recipe_to_nemo_overrides(load_recipe(TINY)))
    assert not any(k.startswith(("model.data.", "exp_manager.")) for k in bare)


def test_the_recipes_seed_becomes_a_positive_nemo_seed():
    """NeMo refuses seed 0, which every shipped recipe uses: seed s becomes s + 1."""
    assert _as_dict(recipe_to_nemo_overrides(load_recipe(TINY)))["model.seed"] == "1"
    assert _as_dict(recipe_to_nemo_overrides(load_recipe(TINY, ["seed=7"])))["model.seed"] == "8"
