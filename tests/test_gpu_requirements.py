"""requirements/gpu.txt (the GPU cluster environment) and the scripts around it: its pins agree
with requirements/current.txt's; the report checks of scripts/gpu_requirements.py on made-up pip
reports, each beside a control that differs in one property; the container route's plan; and
(slow) pip's resolver on the real file and on planted conflicts (scripts/check_gpu_requirements.sh),
the container route's dry run against a stand-in container Python, and the set-up script's refusals.
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
SETUP = ROOT / "scripts/setup_gpu_env.sh"
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
    p = subprocess.run(["shellcheck", "-x", str(CHECK), str(SETUP)], cwd=ROOT,
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
    text = GPU.read_text()
    # control 1: Transformer Engine's core for CUDA 12 against torch's CUDA 13 (pip resolves it)
    cu12 = tmp_path / "gpu-te-cu12.txt"
    cu12.write_text(text.replace("transformer-engine-cu13==", "transformer-engine-cu12=="))
    # control 2: a torch pin that contradicts vLLM 0.32.0's (pip finds no solution)
    old = tmp_path / "gpu-torch-2.12.txt"
    old.write_text(text.replace("torch==2.13.0\n", "torch==2.12.0\n"))
    report = tmp_path / "report.json"
    # The three resolutions at once: each waits on the registry about half its time.
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    runs = [
        subprocess.Popen(["bash", str(CHECK), *args], cwd=ROOT, **pipes)
        for args in (["--report", str(report)], [str(cu12)], [str(old)])
    ]
    ended = []
    for run in runs:
        out, err = run.communicate(timeout=900)
        ended.append(subprocess.CompletedProcess(run.args, run.returncode, out, err))
    p, p_cu12, p_old = ended
    for each in ended:
        _skip_if_cannot_resolve(each)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "torch 2.13.0: CUDA 13" in p.stdout and "vllm 0.32.0" in p.stdout
    names = {gr.normalize(i["metadata"]["name"]) for i in json.loads(report.read_text())["install"]}
    assert {"torch", "vllm", "megatron-core", "transformer-engine-cu13"} <= names

    assert p_cu12.returncode == 1, p_cu12.stdout + p_cu12.stderr
    assert (
        "transformer-engine-cu12 (CUDA 12) but torch 2.13.0 is built for CUDA 13" in p_cu12.stderr
    )
    assert "resolves, but not to the environment it pins" in p_cu12.stderr

    assert p_old.returncode == 1, p_old.stdout + p_old.stderr
    assert "vllm 0.32.0 depends on torch==2.13.0" in p_old.stderr
    assert "resolver found no set of binary wheels" in p_old.stderr


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


# -- scripts/setup_gpu_env.sh -----------------------------------------------------------------
def _path_with_fake_smi(tmp_path, gpu: bool) -> str:
    """PATH whose nvidia-smi lists one GPU (gpu=True) or is absent (only this PATH's tools)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if gpu:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
        smi.chmod(0o755)
    # the system's tools, minus any directory that holds a real nvidia-smi
    dirs = [d for d in os.environ["PATH"].split(":") if not Path(d, "nvidia-smi").exists()]
    return ":".join([str(bin_dir), *dirs])


@pytest.mark.parametrize("gpu", [False, True])
def test_setup_refuses_without_a_gpu(tmp_path, gpu):
    # Both runs point at a folder that is not a venv: with a GPU the script gets past the GPU
    # check and stops there (the control), without one it stops at the GPU check.
    target = tmp_path / "not-a-venv"
    target.mkdir()
    (target / "data.txt").write_text("mine")
    p = _run(["bash", str(SETUP), str(target)], env={"PATH": _path_with_fake_smi(tmp_path, gpu)})
    assert p.returncode in (2, 3), p.stdout + p.stderr
    if gpu:
        if p.returncode == 3:
            pytest.skip("no Python 3.12 interpreter here")
        assert "1 GPU(s): GPU 0: NVIDIA H100" in p.stdout
        assert "exists and is not a virtual environment" in p.stderr
        assert "no GPU here" not in p.stderr
    else:
        assert p.returncode == 2
        assert "no GPU here: nvidia-smi is not on PATH" in p.stderr
        assert "--dry-run" in p.stderr  # says how to preview instead
    assert (target / "data.txt").read_text() == "mine"  # nothing touched


def test_setup_argument_errors(tmp_path):
    cases = [
        (["--bogus"], "unknown option --bogus"),
        (["--no-resolve"], "--no-resolve goes with --dry-run"),
        (["--system", "somewhere"], "--system installs into this Python: give no VENV"),
        (["--requirements", str(tmp_path / "x.txt")], "--requirements: "),
        (["a", "b"], "one VENV only"),
    ]
    for args, msg in cases:
        p = _run(["bash", str(SETUP), *args])
        assert p.returncode == 2, (args, p.stderr)
        assert msg in p.stderr, (args, p.stderr)


def test_setup_dry_run_prints_the_venv_plan(tmp_path):
    venv = tmp_path / "gpu-env"
    p = _run(["bash", str(SETUP), "--dry-run", "--no-resolve", str(venv)],
             env={"PATH": _path_with_fake_smi(tmp_path, False)})  # fmt: skip
    if p.returncode == 3:
        pytest.skip("no Python 3.12 interpreter here")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "dry run on a machine without a GPU" in out
    steps = [line.strip() for line in out.splitlines() if line.startswith("  + ")]
    assert steps[0].endswith(f"-m venv {venv}")
    assert steps[1] == f"+ {venv}/bin/python -m pip install -q -r requirements/pip.txt"
    assert steps[2] == f"+ {venv}/bin/python -m pip install --only-binary=:all: -r {GPU}"
    assert steps[3] == (f"+ {venv}/bin/python -m pip install --no-build-isolation -c {GPU} "
                        "transformer-engine-torch==2.20.2")  # fmt: skip
    assert steps[4] == f"+ {venv}/bin/python -m pip install --no-deps -e ."
    assert not venv.exists()  # a dry run creates nothing


def _fake_container_python(tmp_path, torch_version: str, pip: bool = False) -> Path:
    """A Python 3.12 venv holding only a stand-in `torch` distribution at torch_version (what
    `pip list` sees in a PyTorch container). pip=True: requirements/pip.txt's pip in it (a recent
    pip's fast-deps reads 31 MB where the interpreter's bundled pip 23.2 read 170 MB)."""
    p = subprocess.run(["bash", "-c", f". {ROOT}/scripts/env_lib.sh && find_python 3.12"],
                       capture_output=True, text=True)  # fmt: skip
    if p.returncode != 0:
        pytest.skip("no Python 3.12 interpreter here")
    venv = tmp_path / f"container-{torch_version}"
    subprocess.run([p.stdout.strip(), "-m", "venv", str(venv)], check=True)
    site = next(venv.glob("lib/python3.12/site-packages"))
    (site / "torch").mkdir()
    (site / "torch/__init__.py").write_text(f'__version__ = "{torch_version}"\n')
    info = site / f"torch-{torch_version}.dist-info"
    info.mkdir()
    meta = f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n"
    (info / "METADATA").write_text(meta)
    (info / "RECORD").write_text("torch/__init__.py,,\n")
    if pip:
        pip_txt = ROOT / "requirements/pip.txt"
        cmd = [venv / "bin/python", "-m", "pip", "install", "-q", "-r", pip_txt]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            pytest.skip("could not install requirements/pip.txt: the package registry unreachable?")
    return venv / "bin/python"


def test_setup_system_dry_run_plan(tmp_path):
    py = _fake_container_python(tmp_path, "2.8.0a0+5228986c39.nv25.6")
    path = _path_with_fake_smi(tmp_path, False)
    p = _run(["bash", str(SETUP), "--dry-run", "--no-resolve", "--system"],
             env={"PYTHON": str(py), "PATH": path})  # fmt: skip
    assert p.returncode == 0, p.stderr
    kept = "constraints (the container's builds, kept): torch==2.8.0a0+5228986c39.nv25.6"
    assert kept in p.stdout
    assert "vllm: NOT installed" in p.stdout and "venv route" in p.stdout
    (todo,) = [line for line in p.stdout.splitlines() if "to install: " in line]
    assert "megatron-core==0.19.2" in todo and "vllm" not in todo and "torch==" not in todo
    # a Python that is not 3.12 is refused by name
    p = _run(["bash", str(SETUP), "--dry-run", "--no-resolve", "--system"],
             env={"PYTHON": sys.executable, "PATH": path})  # fmt: skip
    if sys.version_info[:2] != (3, 12):
        assert p.returncode == 2 and f"is Python {sys.version_info[0]}.{sys.version_info[1]}" in (
            p.stderr
        )


@pytest.mark.slow
def test_setup_system_dry_run_resolves_beside_the_containers_torch(tmp_path):
    # The container route's install set resolves against a torch that is not the registry's
    # (an NGC-style build): nothing in it may need to replace that torch. Control: a container
    # torch older than megatron-core 0.19's torch>=2.6.0 must fail to resolve.
    path = _path_with_fake_smi(tmp_path, False)
    py = _fake_container_python(tmp_path, "2.8.0a0+5228986c39.nv25.6", pip=True)
    p = _run(["bash", str(SETUP), "--dry-run", "--system"], env={"PYTHON": str(py), "PATH": path})
    if p.returncode == 1 and "NewConnectionError" in p.stdout + p.stderr:
        pytest.skip("the package registry cannot be reached")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "ok: resolves in this Python, the container's builds kept" in p.stdout
    assert "megatron-core-0.19.2" in p.stdout  # pip's "Would install" line

    old = _fake_container_python(tmp_path, "2.5.0", pip=True)
    p = _run(["bash", str(SETUP), "--dry-run", "--system"], env={"PYTHON": str(old), "PATH": path})
    assert p.returncode == 1, p.stdout + p.stderr
    assert "megatron-core 0.19.2 depends on torch>=2.6.0" in p.stdout
    assert "pip cannot install that into this Python" in p.stderr
