"""Reads requirements/gpu.txt and what pip makes of it; the shell scripts around it call it.

    python scripts/gpu_requirements.py check-report REPORT.json [REQUIREMENTS]
    python scripts/gpu_requirements.py source-build NAME [REQUIREMENTS]
    python scripts/gpu_requirements.py container-plan INSTALLED.json REQS_OUT CONSTRAINTS_OUT \
        [REQUIREMENTS]

check-report: the checks of scripts/check_gpu_requirements.sh on pip's --report of a dry-run
install of the requirements: every pin resolved at its version, the target (Python 3.12, Linux
x86-64), torch's CUDA line, and Transformer Engine's core package on that same line. Exit 0 and a
summary, or exit 1 and one line per problem.
source-build: prints NAME==VERSION from the file's `# source-build: NAME==VERSION` line (the
packages built from source at install time, which the binary-only resolver check leaves out).
container-plan: for scripts/setup_gpu_env.sh --system, from `pip list --format=json` of a
container's Python: what to install there and the constraints that keep the container's own
compiled stack (its torch first of all), with notes on what is left out and why.

Standard library only: it runs under the interpreter being set up, before anything is installed.
REQUIREMENTS defaults to requirements/gpu.txt next to this script.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[1] / "requirements" / "gpu.txt"
TARGET = {"python_version": "3.12", "sys_platform": "linux", "platform_machine": "x86_64"}
_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)$")
_SOURCE_BUILD = re.compile(r"^#\s*source-build:\s*(\S+)\s*$")
_TE_CORE = re.compile(r"^transformer-engine-cu(\d+)$")
# The compiled GPU stack of an NGC PyTorch container: built together against its torch and CUDA,
# so the container route keeps the container's builds (pip constraints) and never replaces them.
CONTAINER_KEEPS = (
    "torch",
    "triton",
    "pytorch-triton",
    "torchvision",
    "torchaudio",
    "numpy",
    "flash-attn",
    "apex",
    "transformer-engine",
    "transformer-engine-cu12",
    "transformer-engine-cu13",
    "transformer-engine-torch",
)


class RequirementsError(ValueError):
    """The requirements file breaks the rules its readers rely on; the message says where."""


def normalize(name: str) -> str:
    """PEP 503: the name pip compares (PyYAML -> pyyaml, latex2sympy2_extended ->
    latex2sympy2-extended)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Pin:
    name: str  # as written
    version: str
    line: int
    tags: tuple[str, ...] = ()  # words of a trailing comment, e.g. ("te-build",)


@dataclass
class Requirements:
    path: Path
    pins: dict[str, Pin] = field(default_factory=dict)  # normalized name -> pin
    source_builds: dict[str, Pin] = field(default_factory=dict)


def read_requirements(path: str | Path = DEFAULT) -> Requirements:
    """Every line NAME==VERSION (a trailing `# word ...` comment tags it); `# source-build:` lines
    name what is built from source. Anything else (ranges, options, -r, URLs) is an error: the file
    is a pinned environment, and the checks compare exact versions."""
    path = Path(path)
    if not path.is_file():
        raise RequirementsError(f"{path}: no such file")
    reqs = Requirements(path)
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        text = raw.strip()
        m = _SOURCE_BUILD.match(text)
        if m:
            pin = _parse_pin(m.group(1), path, n)
            reqs.source_builds[normalize(pin.name)] = pin
            continue
        if not text or text.startswith("#"):
            continue
        body, _, comment = text.partition(" #")
        pin = _parse_pin(body.strip(), path, n)
        pin.tags = tuple(comment.split())
        key = normalize(pin.name)
        if key in reqs.pins:
            raise RequirementsError(
                f"{path}:{n}: {pin.name} is pinned twice (first on line {reqs.pins[key].line})"
            )
        reqs.pins[key] = pin
    if not reqs.pins:
        raise RequirementsError(f"{path}: no NAME==VERSION line")
    return reqs


def _parse_pin(text: str, path: Path, n: int) -> Pin:
    m = _LINE.match(text)
    if m is None:
        raise RequirementsError(
            f"{path}:{n}: {text!r} is not NAME==VERSION (every line of this file is an exact pin)"
        )
    return Pin(m.group(1), m.group(2), n)


def shared_pin_mismatches(a: Requirements, b: Requirements) -> list[str]:
    """One line per package both files pin at different versions."""
    out = []
    for key in sorted(a.pins.keys() & b.pins.keys()):
        pa, pb = a.pins[key], b.pins[key]
        if pa.version != pb.version:
            out.append(
                f"{pa.name}: {a.path.name}:{pa.line} pins {pa.version}, "
                f"{b.path.name}:{pb.line} pins {pb.version}"
            )
    return out


# -- pip's report -----------------------------------------------------------------------------
def _unconditional(requires_dist: list[str]) -> list[str]:
    """Requirements that apply without an extra (markers on platform/python are kept: the target
    is Linux, where torch's CUDA requirements apply)."""
    return [r for r in requires_dist if "extra ==" not in r and "extra==" not in r]


def _req_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    return normalize(m.group(1)) if m else ""


def torch_cuda_line(requires_dist: list[str]) -> tuple[set[int], list[str]]:
    """The CUDA major versions torch's own requirements name (cuda-toolkit==13.x, nvidia-*-cu13,
    nvidia-cuda-runtime-cu12==12.x ...), and those requirements. A CPU build names none."""
    majors: set[int] = set()
    named = []
    for req in _unconditional(requires_dist):
        name = _req_name(req)
        m = re.match(r"nvidia-.*-cu(\d+)$", name)
        if m:
            majors.add(int(m.group(1)))
            named.append(req.split(";")[0].strip())
        elif name == "cuda-toolkit":
            v = re.search(r"==\s*(\d+)\.", req)
            if v:
                majors.add(int(v.group(1)))
                named.append(req.split(";")[0].strip())
    return majors, named


def check_report(report: dict, reqs: Requirements) -> tuple[list[str], list[str]]:
    """(summary lines, problems) for pip's --report of a dry-run install of `reqs`."""
    problems: list[str] = []
    env = report.get("environment", {})
    for key, want in TARGET.items():
        if env.get(key) != want:
            problems.append(
                f"resolved for {key}={env.get(key)!r}, the target is {want!r} (run the check "
                "with a Python 3.12 interpreter on Linux x86-64)"
            )
    installed = {normalize(i["metadata"]["name"]): i for i in report.get("install", [])}
    if not installed:
        return [], [*problems, "the report installs nothing: pip resolved no package"]

    def version(key: str) -> str | None:
        item = installed.get(key)
        return item["metadata"]["version"] if item else None

    for key, pin in reqs.pins.items():
        got = version(key)
        if got is None:
            problems.append(
                f"{pin.name}=={pin.version} (line {pin.line}) is not in the resolved set"
            )
        elif got != pin.version:
            problems.append(f"{pin.name}=={pin.version} (line {pin.line}) resolved to {got}")
    for key, item in installed.items():
        url = item.get("download_info", {}).get("url", "")
        if not url.endswith(".whl"):
            problems.append(f"{key} {version(key)} resolved to a non-wheel: {url}")

    summary = [f"resolved {len(installed)} packages for Python 3.12 on Linux x86-64"]
    torch = installed.get("torch")
    torch_major = None
    if torch is None:
        problems.append("torch is not in the resolved set")
    else:
        majors, named = torch_cuda_line(torch["metadata"].get("requires_dist") or [])
        if not majors:
            problems.append(
                f"torch {version('torch')} names no CUDA library among its requirements (a CPU "
                "build?): the cluster environment needs torch's CUDA build"
            )
        elif len(majors) > 1:
            problems.append(f"torch {version('torch')} names several CUDA lines: {sorted(majors)}")
        else:
            torch_major = majors.pop()
            runtimes = (
                "cuda-toolkit",
                "nvidia-cuda-runtime",
                f"nvidia-cuda-runtime-cu{torch_major}",
            )
            runtime = [f"{k} {version(k)}" for k in runtimes if k in installed]
            summary.append(
                f"torch {version('torch')}: CUDA {torch_major} ({', '.join(runtime) or 'runtime'}"
                f"; torch requires {', '.join(named[:3])}{' ...' if len(named) > 3 else ''})"
            )

    te_cores = sorted(k for k in installed if _TE_CORE.match(k))
    te_version = version("transformer-engine")
    if not te_cores:
        problems.append("no Transformer Engine core package (transformer-engine-cuNN) resolved")
    elif len(te_cores) > 1:
        problems.append(f"several Transformer Engine core packages resolved: {', '.join(te_cores)}")
    else:
        core = te_cores[0]
        te_major = int(_TE_CORE.match(core).group(1))
        if torch_major is not None and te_major != torch_major:
            problems.append(
                f"Transformer Engine's core package is {core} (CUDA {te_major}) but torch "
                f"{version('torch')} is built for CUDA {torch_major}: pin "
                f"transformer-engine-cu{torch_major}=={version(core)} instead (TE's CUDA line "
                "must be torch's)"
            )
        if te_version is not None and version(core) != te_version:
            problems.append(
                f"{core} {version(core)} differs from transformer-engine {te_version}: one release"
            )
        ext = reqs.source_builds.get("transformer-engine-torch")
        if ext is None:
            problems.append(
                "no `# source-build: transformer-engine-torch==VERSION` line: the set-up script "
                "builds TE's PyTorch extension at the version that line gives"
            )
        elif ext.version != version(core):
            problems.append(
                f"the source-built transformer-engine-torch=={ext.version} (line {ext.line}) "
                f"differs from {core} {version(core)}: one Transformer Engine release"
            )
        summary.append(
            f"Transformer Engine {te_version}: {core} (CUDA {te_major}); transformer-engine-torch "
            "is built from source at install time (not part of this binary-only check)"
        )
    for key in ("vllm", "megatron-core"):
        if key in installed:
            summary.append(f"{key} {version(key)}")
    return summary, problems


# -- the container route ----------------------------------------------------------------------
def container_plan(
    installed: dict[str, str], reqs: Requirements
) -> tuple[list[str], list[str], list[str]]:
    """(requirement lines, constraint lines, notes) for installing into a container's Python.

    `installed`: normalized name -> version of what the container has. The container keeps its
    compiled stack (CONTAINER_KEEPS, each pinned to its installed version by a constraint), so no
    line of the file that names one of them is installed; Transformer Engine's extension build
    requirements (lines tagged `te-build`) go with TE. vLLM from the registry pins an exact torch:
    it is installed only where the container's torch is exactly that version."""
    if "torch" not in installed:
        raise RequirementsError(
            "this Python has no torch: the container route installs into a PyTorch container "
            "(e.g. nvcr.io/nvidia/pytorch:<tag>); elsewhere use the venv route"
        )
    constraints = [f"{k}=={installed[k]}" for k in CONTAINER_KEEPS if k in installed]
    lines, notes = [], []
    kept = [k for k in CONTAINER_KEEPS if k in installed]
    notes.append("keeps the container's " + ", ".join(f"{k} {installed[k]}" for k in kept))
    torch_pin = reqs.pins.get("torch")
    for key, pin in reqs.pins.items():
        if key in CONTAINER_KEEPS and key in installed:
            if installed[key] != pin.version:
                notes.append(
                    f"{pin.name}: the container's {installed[key]} is kept ({reqs.path.name} "
                    f"pins {pin.version})"
                )
            continue
        if key.startswith("transformer-engine") or "te-build" in pin.tags:
            continue  # TE is the container's (built for its torch), or absent: see below
        if key == "vllm":
            if "vllm" in installed:
                notes.append(f"vllm: the container's own vLLM {installed['vllm']} is used")
                continue
            if torch_pin is None or installed["torch"] != torch_pin.version:
                notes.append(
                    f"vllm: NOT installed. vLLM {pin.version} from the registry pins "
                    f"torch=={torch_pin.version if torch_pin else '?'}, and this container's torch "
                    f"is {installed['torch']}: it cannot be installed from the registry into this "
                    "container without replacing the container's torch. Use a container that "
                    "ships vLLM for its own torch (the container's vLLM is then used), or the "
                    "venv route (bash scripts/setup_gpu_env.sh), which installs torch and vLLM "
                    "together"
                )
                continue
        lines.append(f"{pin.name}=={pin.version}")
    if not any(k.startswith("transformer-engine") for k in installed):
        notes.append(
            "transformer-engine: the container has none; the Transformer Engine layer spec is "
            "unavailable there (model.transformer_impl=local runs without it)"
        )
    return lines, constraints, notes


# -- command line -----------------------------------------------------------------------------
def _usage() -> int:
    print("usage:\n" + __doc__.split("\n\n")[1], file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        return _usage()
    cmd, args = argv[0], argv[1:]
    try:
        if cmd == "check-report" and len(args) in (1, 2):
            reqs = read_requirements(args[1] if len(args) == 2 else DEFAULT)
            report_path = Path(args[0])
            if not report_path.is_file():
                raise RequirementsError(f"REPORT: {report_path}: no such file")
            summary, problems = check_report(json.loads(report_path.read_text()), reqs)
            for line in summary:
                print(f"  {line}")
            for line in problems:
                print(f"FAIL: {line}", file=sys.stderr)
            return 1 if problems else 0
        if cmd == "source-build" and len(args) in (1, 2):
            reqs = read_requirements(args[1] if len(args) == 2 else DEFAULT)
            pin = reqs.source_builds.get(normalize(args[0]))
            if pin is None:
                raise RequirementsError(f"{reqs.path}: no `# source-build: {args[0]}==...` line")
            print(f"{pin.name}=={pin.version}")
            return 0
        if cmd == "container-plan" and len(args) in (3, 4):
            reqs = read_requirements(args[3] if len(args) == 4 else DEFAULT)
            listed = json.loads(Path(args[0]).read_text())
            installed = {normalize(d["name"]): d["version"] for d in listed}
            lines, constraints, notes = container_plan(installed, reqs)
            Path(args[1]).write_text("".join(f"{x}\n" for x in lines))
            Path(args[2]).write_text("".join(f"{x}\n" for x in constraints))
            for note in notes:
                print(note)
            return 0
    except RequirementsError as e:
        print(f"gpu_requirements: {e}", file=sys.stderr)
        return 2
    return _usage()


if __name__ == "__main__":
    sys.exit(main())
