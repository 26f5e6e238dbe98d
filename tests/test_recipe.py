"""Recipes: every file in recipes/ loads; unknown keys and wrong types fail with the key named."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ba.recipe import Recipe, RecipeError, apply_overrides, load_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def test_there_are_recipes():
    names = {p.name for p in RECIPES}
    assert {"tiny-cpu.yaml", "tiny-cpu-tp2.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads(path):
    recipe = load_recipe(path)
    assert isinstance(recipe, Recipe)
    assert recipe.name == path.stem


def test_overrides_and_types(tmp_path):
    r = load_recipe(
        ROOT / "recipes/tiny-cpu.yaml",
        ["loss.rule=token", "grpo.steps=7", "loss.dual_clip=3", "optimizer.lr=1e-4"],
    )
    assert (r.loss.rule, r.grpo.steps, r.loss.dual_clip, r.optimizer.lr) == ("token", 7, 3.0, 1e-4)
    r.dump(tmp_path / "r.yaml")
    assert load_recipe(tmp_path / "r.yaml") == r  # a dumped recipe loads back identical


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("grpo.group_sise=8", r"^grpo\.group_sise: unknown key \(did you mean 'group_size'\?\)"),
        ("grpo.steps=ten", r"^grpo\.steps: expected int, got 'ten'"),
        ("grpo.steps=2.5", r"^grpo\.steps: expected int"),
        ("loss.rule=mean", r"^loss\.rule: must be one of"),
        ("loss.scope=global", r"^loss\.scope: must be one of"),
        ("grpo.group_size=1", r"^grpo\.group_size: must be >= 2"),
        ("parallel.tp=3", r"^parallel\.tp: .*num_query_groups=2 is not a multiple of tp=3"),
        ("model=5", r"^model: expected a mapping"),
        ("nonsense=1", r"^nonsense: unknown key"),
        ("loss.rule", r"expected key\.path=value"),
        ("warmstart.correct_fraction=1.5", r"^warmstart\.correct_fraction: must be in \[0, 1\]"),
    ],
)
def test_bad_recipes_name_the_key(override, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(ROOT / "recipes/tiny-cpu.yaml", [override])


def test_token_budgets_with_expert_parallelism_are_refused_by_name():
    """The experts' dispatcher exchanges every micro-batch's tokens across DP ranks, whose
    token-budget micro-batches differ (gloo aborted on a size mismatch); the control: EP1."""
    moe = ROOT / "recipes/tiny-moe-cpu.yaml"
    with pytest.raises(RecipeError, match=r"^parallel\.max_tokens_per_microbatch: token-budget"):
        load_recipe(moe, ["parallel.max_tokens_per_microbatch=1024"])
    load_recipe(moe, ["parallel.max_tokens_per_microbatch=1024", "parallel.ep=1"])


def test_apply_overrides_creates_sections():
    assert apply_overrides({}, ["a.b.c=1", "a.d=[1, 2]"]) == {"a": {"b": {"c": 1}, "d": [1, 2]}}


def test_missing_file():
    with pytest.raises(RecipeError, match="no such file"):
        load_recipe(ROOT / "recipes/nope.yaml")


def _undocumented(text: str, cls=Recipe, prefix: str = "") -> list[str]:
    """The recipe's keys (a section's nested sections key by key) that `text` does not name."""
    import dataclasses

    missing = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        section = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if section is not None and dataclasses.is_dataclass(section):
            missing += _undocumented(text, section, f"{key}.")
        elif f"`{key}`" not in text:
            missing.append(key)
    return missing


def test_docs_name_every_key():
    text = (ROOT / "docs/recipes.md").read_text()
    assert _undocumented(text) == []
    # negative control: a page without the loss.rule row is caught
    assert _undocumented(text.replace("`loss.rule`", "")) == ["loss.rule"]
    assert _undocumented(text.replace("`logging.wandb.mode`", "")) == ["logging.wandb.mode"]


def test_every_key_is_read_by_the_code():
    from recipe_keys import keys_read, recipe_keys

    keys = recipe_keys(Recipe)
    assert sorted(set(keys) - keys_read(ROOT / "megatron_ba", keys)) == []


def test_the_key_reader_catches_an_unread_key():
    """Negative controls: a key no code reads, and a key read only by validate(), are caught."""
    from recipe_keys import keys_read, recipe_keys

    keys = {**recipe_keys(Recipe), "grpo.unused_knob": "GRPOSection"}
    sources = {p: p.read_text() for p in sorted((ROOT / "megatron_ba").rglob("*.py"))}
    assert "grpo.unused_knob" not in keys_read(ROOT / "megatron_ba", keys, sources)
    checks_py = ROOT / "megatron_ba" / "recipe" / "validation.py"
    sources[checks_py] += "\n\ndef validate_more(recipe):\n    return recipe.grpo.unused_knob\n"
    assert "grpo.unused_knob" not in keys_read(ROOT / "megatron_ba", keys, sources)
    sources[ROOT / "megatron_ba" / "x.py"] = "def f(r):\n    g = r.grpo\n    return g.unused_knob\n"
    assert "grpo.unused_knob" in keys_read(ROOT / "megatron_ba", keys, sources)


def test_unimplemented_keys_are_refused_by_name(monkeypatch):
    import megatron_ba.recipe.loading as recipe_mod

    # No key is unimplemented today (parallel.sequence_parallel now is read): the mechanism is
    # checked with a planted entry.
    monkeypatch.setitem(recipe_mod.NOT_IMPLEMENTED, "parallel.pipelined_dreams", "dreams")
    with pytest.raises(
        RecipeError, match=r"^parallel\.pipelined_dreams: not implemented yet: .+; remove it$"
    ):
        load_recipe(ROOT / "recipes/tiny-cpu.yaml", ["parallel.pipelined_dreams=true"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.pretrained=/m"], r"^warmstart\.enabled: must be false with model\.pretrained"),
        (
            ["model.pretrained=/m", "warmstart.enabled=false"],
            r"^tokenizer\.kind: must be hf with model\.pretrained",
        ),
        (["warmstart.enabled=false"], r"^warmstart\.enabled: false needs model\.pretrained"),
        (["data.task=math"], r"^data\.path: data\.task: math needs a data file"),
        (["data.task=math", "data.path=x"], r"^model\.pretrained: data\.task: math trains"),
        (["tokenizer.kind=sentencepiece"], r"^tokenizer\.kind: one of trained-bpe, hf"),
        (["eval.benchmarks=math500,gsm8k"], r"^eval\.benchmarks: 'gsm8k' is not one of"),
        (["eval.benchmarks=5"], r"^eval\.benchmarks: expected a list of str, got 5"),
        (["reward.workers=0"], r"^reward\.workers: must be >= 1"),
        (
            [
                "data.task=math",
                "data.path=x",
                "model.pretrained=/m",
                "warmstart.enabled=false",
                "tokenizer.kind=hf",
                "data.dataset=gsm8k",
            ],
            r"^data\.dataset: must be one of dapo-math-17k, polaris",
        ),
    ],
)
def test_real_model_keys_are_checked_together(overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(ROOT / "recipes/tiny-cpu.yaml", overrides)


def test_benchmark_and_template_names_match_the_data_module():
    from megatron_ba.data.benchmarks import BENCHMARKS
    from megatron_ba.data.templates import MATH_TEMPLATES
    from megatron_ba.recipe import BENCHMARK_NAMES, MATH_TEMPLATE_NAMES

    assert tuple(BENCHMARKS) == BENCHMARK_NAMES
    assert MATH_TEMPLATES == MATH_TEMPLATE_NAMES


PAPER_RECIPES = sorted(p for p in RECIPES if p.name.startswith("qwen"))


def test_the_papers_recipes_are_shipped():
    names = {p.stem for p in PAPER_RECIPES}
    assert names == {
        "qwen2.5-math-7b-dapo17k",
        "qwen3-1.7b-dapo17k",
        "qwen2.5-math-7b-polaris",
        "qwen3-1.7b-polaris",
        "qwen2.5-32b-dapo17k-16k",
        "qwen2.5-32b-dapo17k-32k",
        "qwen2.5-math-7b-dapo17k-32k",  # YaRN (model.rope_scaling) past the 4K context
        "qwen3-32b-dapo17k-64k",  # YaRN past the 32K context
        "qwen3-30b-a3b-dapo17k-16k",  # mixture of experts, expert parallelism 8
        "qwen3.5-35b-a3b-dapo17k-16k",  # Gated DeltaNet hybrid, mixture of experts, EP 8
    }


@pytest.mark.parametrize("path", PAPER_RECIPES, ids=lambda p: p.name)
def test_paper_recipe_settings_and_the_planners_layout(path):
    """The paper's settings, and the parallel section is what the header's planner call
    (`# layout: megatron-ba layout ...`) proposes for it."""
    import json
    import shlex
    import subprocess
    import sys

    r = load_recipe(path)
    assert (r.grpo.group_size, r.grpo.prompts_per_step, r.grpo.steps) == (16, 128, 500)
    assert (r.optimizer.lr, r.loss.clip_low, r.loss.clip_high) == (1e-6, 0.2, 0.28)
    assert (r.grpo.temperature, r.eval.samples, r.loss.rule) == (1.0, 8, "balanced")
    assert len(r.eval.benchmarks) == 6
    line = next(x for x in path.read_text().splitlines() if x.startswith("# layout: "))
    argv = shlex.split(line.removeprefix("# layout: megatron-ba "))
    flags = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert int(flags["--max-response-len"]) == r.grpo.max_new_tokens
    assert int(flags["--group-size"]) == r.grpo.group_size
    assert int(flags["--prompts-per-step"]) == r.grpo.prompts_per_step
    out = subprocess.run(
        [sys.executable, "-m", "megatron_ba.cli", *argv, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    overrides = json.loads(out.stdout)["overrides"]
    planned = load_recipe(path, overrides)
    assert r.parallel == planned.parallel, f"the planner says {overrides}"
    # The colocated engine as the estimate assumes it (its share of the GPU, asleep in training).
    assert r.rollout == planned.rollout, f"the planner says {overrides}"


def test_eval_benchmarks_from_the_command_line():
    r = load_recipe(ROOT / "recipes/tiny-hf-cpu.yaml", ["eval.benchmarks=math500,aime25"])
    assert r.eval.benchmarks == ["math500", "aime25"]
    assert r.model.set_shape_keys() == {} and r.model.pretrained == "runs/tiny-qwen3"


def test_only_implemented_backends_load():
    backends = "local, nemo_aligner, verl, nemo_rl"
    with pytest.raises(RecipeError, match=rf"^backend: must be one of {backends}$"):
        load_recipe(ROOT / "recipes/tiny-cpu.yaml", ["backend=trl"])


def test_nemo_aligner_backend_prints_its_overrides():
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "megatron_ba.cli", "train", "recipes/tiny-cpu-tp2.yaml"]
    out = subprocess.run(
        [
            *cmd,
            "backend=nemo_aligner",
            "parallel.micro_batch_size=8",
            "--print-overrides",
            "--nodes",
            "2",
            "--devices",
            "8",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "++trainer.num_nodes=2" in lines and "++trainer.devices=8" in lines
    assert "++model.tensor_model_parallel_size=2" in lines and "++model.grpo.rule=balanced" in lines
    # The local backend has no overrides to print.
    local = subprocess.run([*cmd, "--print-overrides"], cwd=ROOT, capture_output=True, text=True)
    assert local.returncode == 2 and "is for backend=nemo_aligner" in local.stderr


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_translates_for_nemo_aligner(path):
    """`--print-overrides` prints a translation for every shipped recipe (a Hugging Face
    checkpoint becomes Hydra's mandatory `???`, with a note on converting it to .nemo), or
    refuses model.rope_scaling by name (the long-context recipes)."""
    import subprocess
    import sys

    r = load_recipe(path)
    out = subprocess.run(  # one node of TP x PP devices: one data-parallel replica
        [
            sys.executable,
            "-m",
            "megatron_ba.cli",
            "train",
            str(path),
            "backend=nemo_aligner",
            "--print-overrides",
            "--accelerator",
            "gpu",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if r.model.rope_scaling.type is not None:  # the .nemo decides RoPE: the key is refused
        assert out.returncode == 2 and "model.rope_scaling: the nemo_aligner" in out.stderr
        return
    if r.parallel.ep != 1:  # expert parallelism is the local backend's: the key is refused
        assert out.returncode == 2 and "parallel.ep: expert parallelism" in out.stderr
        return
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert f"++model.tensor_model_parallel_size={r.parallel.tp}" in lines
    assert f"++model.megatron_amp_O2={str(r.model.precision == 'bf16').lower()}" in lines
    if r.model.pretrained:
        assert "++pretrained_checkpoint.restore_from_path=???" in lines
        assert "convert it to .nemo" in out.stderr
