"""requirements/gpu.txt (the GPU cluster environment) and the scripts around it: its pins agree
with requirements/current.txt's; the report checks of scripts/gpu_requirements.py on made-up pip
reports, each beside a control that differs in one property; the container route's plan; and
(slow) pip's resolver on the real file and on planted conflicts (scripts/check_gpu_requirements.sh).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "requirements/gpu.txt"
CURRENT = ROOT / "requirements/current.txt"
CHECK = ROOT / "scripts/check_gpu_requirements.sh"
# The packages both environments must pin alike (the stack the megatron-core 0.19 CPU suite runs).
SHARED = ["transformers", "tokenizers", "safetensors", "numpy", "pyyaml", "datasets", "pyarrow",
          "math-verify", "latex2sympy2-extended", "matplotlib", "tqdm", "torch",
          "megatron-core"]  # fmt: skip


def _module():
    path = ROOT / "scripts/gpu_requirements.py"
    spec = importlib.util.spec_from_file_location("gpu_requirements", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_requirements"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gr = _module()


# -- the pins ---------------------------------------------------------------------------------
def test_gpu_and_current_pin_the_shared_packages_alike():
    gpu, cur = gr.read_requirements(GPU), gr.read_requirements(CURRENT)
    for name in SHARED:
        assert name in gpu.pins, f"{name} missing from {GPU.name}"
        assert name in cur.pins, f"{name} missing from {CURRENT.name}"
    assert gr.shared_pin_mismatches(gpu, cur) == []


def test_shared_pin_check_names_a_difference(tmp_path):
    # control: current.txt with one version changed (transformers) must be reported, by name
    text = CURRENT.read_text()
    assert "transformers==5.19.0\n" in text
    changed = tmp_path / "current.txt"
    changed.write_text(text.replace("transformers==5.19.0\n", "transformers==5.18.0\n"))
    out = gr.shared_pin_mismatches(gr.read_requirements(GPU), gr.read_requirements(changed))
    assert len(out) == 1
    assert out[0].startswith("transformers: gpu.txt:") and "pins 5.19.0" in out[0]
    assert "pins 5.18.0" in out[0]


def test_gpu_txt_shape():
    reqs = gr.read_requirements(GPU)
    assert reqs.pins["torch"].version == "2.13.0"
    assert reqs.pins["vllm"].version == "0.32.0"
    assert reqs.pins["megatron-core"].version.startswith("0.19.")
    assert reqs.pins["transformer-engine-cu13"].version == reqs.pins["transformer-engine"].version
    assert (
        reqs.source_builds["transformer-engine-torch"].version
        == reqs.pins["transformer-engine"].version
    )
    assert not any(k.startswith("transformer-engine-cu12") for k in reqs.pins)  # one CUDA line
    assert "transformer-engine-torch" not in reqs.pins  # an sdist: not a line of the binary check
    assert "te-build" in reqs.pins["nvdlfw-inspect"].tags


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("vllm>=0.32\n", "is not NAME==VERSION"),
        ("-r other.txt\n", "is not NAME==VERSION"),
        ("torch==2.13.0\nTorch==2.13.0\n", "pinned twice"),
        ("# only a comment\n", "no NAME==VERSION line"),
    ],
)
def test_bad_requirement_files_are_named(tmp_path, line, why):
    f = tmp_path / "reqs.txt"
    f.write_text(line)
    with pytest.raises(gr.RequirementsError, match=why) as e:
        gr.read_requirements(f)
    assert str(f) in str(e.value)


# -- the report checks, on made-up reports ---------------------------------------------------
def _item(name, version, requires=()):
    url = f"https://files.example/{name}-{version}-py3-none-any.whl"
    return {
        "download_info": {"url": url},
        "metadata": {"name": name, "version": version, "requires_dist": list(requires)},
    }


TORCH_CU13 = [
    "filelock",
    'cuda-toolkit[cublas,cudart]==13.0.3; platform_system == "Linux"',
    'nvidia-cudnn-cu13==9.20.0.48; platform_system == "Linux"',
    'nvidia-nccl-cu13==2.29.7; platform_system == "Linux"',
    'pyyaml; extra == "pyyaml"',
]


def _good_report():
    """What pip reports for requirements/gpu.txt, reduced: every pin, torch's CUDA 13 line."""
    reqs = gr.read_requirements(GPU)
    items = []
    for pin in reqs.pins.values():
        items.append(_item(pin.name, pin.version, TORCH_CU13 if pin.name == "torch" else ()))
    items += [_item("cuda-toolkit", "13.0.3.0"), _item("nvidia-cudnn-cu13", "9.20.0.48")]
    return {"environment": dict(gr.TARGET), "install": items}, reqs


def _set(report, pkg, **meta):
    for item in report["install"]:
        if item["metadata"]["name"] == pkg:
            item["metadata"].update(meta)
            return report
    raise KeyError(pkg)


def test_report_check_passes_the_good_report():
    report, reqs = _good_report()
    summary, problems = gr.check_report(report, reqs)
    assert problems == []
    assert any(line.startswith("torch 2.13.0: CUDA 13 (cuda-toolkit 13.0.3.0") for line in summary)
    assert any("transformer-engine-cu13 (CUDA 13)" in line for line in summary)


def test_report_check_te_on_another_cuda_line():
    report, reqs = _good_report()
    _set(report, "transformer-engine-cu13", name="transformer-engine-cu12")
    _, problems = gr.check_report(report, reqs)
    assert any(
        "core package is transformer-engine-cu12 (CUDA 12) but torch 2.13.0 is built for CUDA 13"
        in p
        for p in problems
    ), problems


def test_report_check_torch_resolved_to_another_version():
    report, reqs = _good_report()
    _set(report, "torch", version="2.12.0")
    _, problems = gr.check_report(report, reqs)
    line = reqs.pins["torch"].line
    assert problems == [f"torch==2.13.0 (line {line}) resolved to 2.12.0"], problems


def test_report_check_cpu_torch():
    report, reqs = _good_report()
    _set(report, "torch", requires_dist=["filelock", "sympy>=1.13.3"])
    _, problems = gr.check_report(report, reqs)
    assert any("names no CUDA library" in p for p in problems), problems


def test_report_check_other_target():
    report, reqs = _good_report()
    report["environment"]["python_version"] = "3.11"
    _, problems = gr.check_report(report, reqs)
    assert any("python_version='3.11', the target is '3.12'" in p for p in problems), problems


def test_report_check_source_build_version():
    report, reqs = _good_report()
    reqs = copy.deepcopy(reqs)
    reqs.source_builds["transformer-engine-torch"].version = "2.20.1"
    _, problems = gr.check_report(report, reqs)
    assert any("transformer-engine-torch==2.20.1" in p for p in problems), problems


def test_report_check_a_pin_missing_and_a_source_distribution():
    report, reqs = _good_report()
    report["install"] = [i for i in report["install"] if i["metadata"]["name"] != "vllm"]
    report["install"][0]["download_info"]["url"] = "https://files.example/x-1.0.tar.gz"
    _, problems = gr.check_report(report, reqs)
    line = reqs.pins["vllm"].line
    missing = f"vllm==0.32.0 (line {line}) is not in the resolved set"
    assert any(p.startswith(missing) for p in problems), problems
    assert any("resolved to a non-wheel" in p for p in problems), problems


# -- the container route's plan ---------------------------------------------------------------
NGC = {"torch": "2.8.0a0+5228986c39.nv25.6", "numpy": "1.26.4", "transformer-engine": "2.4.0",
       "triton": "3.3.0", "pip": "25.0"}  # fmt: skip


def test_container_plan_keeps_the_containers_torch_and_leaves_vllm_out():
    lines, constraints, notes = gr.container_plan(dict(NGC), gr.read_requirements(GPU))
    assert "torch==2.8.0a0+5228986c39.nv25.6" in constraints
    assert "numpy==1.26.4" in constraints and "transformer-engine==2.4.0" in constraints
    names = {line.split("==")[0] for line in lines}
    assert "megatron-core" in names and "transformers" in names
    assert not names & {"torch", "numpy", "vllm", "transformer-engine", "transformer-engine-cu13"}
    assert not names & {"nvdlfw-inspect", "onnx", "wheel"}  # TE's build group goes with TE
    (vllm,) = [n for n in notes if n.startswith("vllm:")]
    assert "cannot be installed from the registry into this container" in vllm
    assert "venv route" in vllm


def test_container_plan_installs_vllm_when_torch_is_the_pinned_one():
    # control: the same container with torch exactly the registry's 2.13.0
    lines, constraints, notes = gr.container_plan({**NGC, "torch": "2.13.0"},
                                                  gr.read_requirements(GPU))  # fmt: skip
    assert "vllm==0.32.0" in lines and "torch==2.13.0" in constraints
    assert not [n for n in notes if n.startswith("vllm:")]


def test_container_plan_uses_the_containers_vllm_and_needs_torch():
    lines, _, notes = gr.container_plan({**NGC, "vllm": "0.9.0"}, gr.read_requirements(GPU))
    assert not [x for x in lines if x.startswith("vllm")]
    assert "vllm: the container's own vLLM 0.9.0 is used" in notes
    no_torch = {k: v for k, v in NGC.items() if k != "torch"}
    with pytest.raises(gr.RequirementsError, match="this Python has no torch"):
        gr.container_plan(no_torch, gr.read_requirements(GPU))


# -- the scripts ------------------------------------------------------------------------------
def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    p = subprocess.run(["shellcheck", "-x", str(CHECK)], cwd=ROOT,
                       capture_output=True, text=True)  # fmt: skip
    assert p.returncode == 0, p.stdout


def _run(args, env=None, cwd=None, timeout=600):
    return subprocess.run(args, cwd=cwd or ROOT, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def _skip_if_cannot_resolve(p):
    if p.returncode == 3:
        pytest.skip(f"no Python 3.12 interpreter here: {p.stderr.strip()[-300:]}")
    if p.returncode == 4:
        pytest.skip(f"the package registry cannot be reached: {p.stderr.strip()[-300:]}")


@pytest.mark.slow
def test_resolver_check_passes_the_file_and_fails_planted_conflicts(tmp_path):
    report = tmp_path / "report.json"
    p = _run(["bash", str(CHECK), "--report", str(report)])
    _skip_if_cannot_resolve(p)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "torch 2.13.0: CUDA 13" in p.stdout and "vllm 0.32.0" in p.stdout
    names = {gr.normalize(i["metadata"]["name"]) for i in json.loads(report.read_text())["install"]}
    assert {"torch", "vllm", "megatron-core", "transformer-engine-cu13"} <= names

    text = GPU.read_text()
    # control 1: Transformer Engine's core for CUDA 12 against torch's CUDA 13 (pip resolves it)
    cu12 = tmp_path / "gpu-te-cu12.txt"
    cu12.write_text(text.replace("transformer-engine-cu13==", "transformer-engine-cu12=="))
    p = _run(["bash", str(CHECK), str(cu12)])
    _skip_if_cannot_resolve(p)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "transformer-engine-cu12 (CUDA 12) but torch 2.13.0 is built for CUDA 13" in p.stderr
    assert "resolves, but not to the environment it pins" in p.stderr

    # control 2: a torch pin that contradicts vLLM 0.32.0's (pip finds no solution)
    old = tmp_path / "gpu-torch-2.12.txt"
    old.write_text(text.replace("torch==2.13.0\n", "torch==2.12.0\n"))
    p = _run(["bash", str(CHECK), str(old)])
    _skip_if_cannot_resolve(p)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "vllm 0.32.0 depends on torch==2.13.0" in p.stderr
    assert "resolver found no set of binary wheels" in p.stderr


def test_resolver_check_says_when_the_registry_is_unreachable(tmp_path):
    # Nothing listens on loopback port 9: the probe fails on a network error -> exit 4 (the skip
    # above); the real registry run must not take this path (it exits 0 or 1 there).
    env = {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "https://127.0.0.1:9/simple",
           "PIP_TIMEOUT": "5", "PIP_FIND_LINKS": ""}  # fmt: skip
    p = _run(["bash", str(CHECK)], env=env, timeout=300)
    if p.returncode == 3:
        pytest.skip(f"no Python 3.12 interpreter here: {p.stderr.strip()[-300:]}")
    assert p.returncode == 4, p.stdout + p.stderr
    assert "the package registry cannot be reached" in p.stderr


def test_resolver_check_arguments(tmp_path):
    p = _run(["bash", str(CHECK), str(tmp_path / "nope.txt")])
    assert p.returncode == 2 and "REQUIREMENTS: " in p.stderr and "no such file" in p.stderr
    p = _run(["bash", str(CHECK), "--report"])
    assert p.returncode == 2 and "--report: needs a file path" in p.stderr
    p = _run(["bash", str(CHECK), "--frobnicate"])
    assert p.returncode == 2 and "unknown option --frobnicate" in p.stderr
