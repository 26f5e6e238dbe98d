#!/usr/bin/env bash
# The GPU cluster environment of requirements/gpu.txt, on a GPU node: a Python 3.12 venv, or a
# PyTorch container's own Python. What has run where: docs/status.md.
#
#   bash scripts/setup_gpu_env.sh [VENV]          # venv route; VENV defaults to .venv-gpu
#   bash scripts/setup_gpu_env.sh --system        # container route: this Python (PYTHON, else python3)
#   bash scripts/setup_gpu_env.sh --dry-run [--system] [VENV]   # the plan and the resolver check
#   options: --requirements FILE (default requirements/gpu.txt); --no-resolve (with --dry-run:
#   print the plan only, without running pip's resolver)
#
# Venv route:
#   1. VENV from a Python 3.12 interpreter (find_python 3.12, scripts/env_lib.sh: PYTHON, then
#      python3.12 on PATH, then pyenv's), with requirements/pip.txt's pip; an existing VENV of
#      Python 3.12 is updated in place, anything else there is refused
#   2. pip install --only-binary=:all: -r requirements/gpu.txt (torch 2.13.0 with CUDA 13 wheels,
#      vLLM, megatron-core, Transformer Engine's core library, ...)
#   3. Transformer Engine's PyTorch extension, built against that torch:
#        pip install --no-build-isolation -c requirements/gpu.txt transformer-engine-torch==<pin>
#      (the pin is gpu.txt's `# source-build:` line). Its setup.py first tries a prebuilt wheel for
#      this torch and CUDA from TE's release page and compiles when there is none
#      (NVTE_PYTORCH_FORCE_BUILD=TRUE always compiles); compiling needs nvcc of torch's CUDA major
#      (13) and a C++ compiler. How long it takes has not been measured.
#   4. pip install --no-deps -e .  (this checkout)
#   5. the import check: torch sees a GPU, transformer_engine.pytorch and vllm import,
#      megatron-core is the pinned version, megatron_ba imports; a failure says which
# Container route (--system), inside e.g. nvcr.io/nvidia/pytorch:<tag> on a GPU node: installs
# what the container lacks into its Python (which must be 3.12, as the pins are), with pip
# constraints that pin the container's torch and the rest of its compiled stack (numpy, triton,
# Transformer Engine, ...; scripts/gpu_requirements.py CONTAINER_KEEPS) at their installed
# versions, so none of them is replaced. vLLM 0.32.0 from the registry pins torch==2.13.0: where
# the container's torch is another version (an NGC build, versioned like 2.x.0a0+<commit>, is), vLLM
# cannot be installed from the registry into that container; the script says so and leaves it
# out: use a container that ships its own vLLM (it is then used), or the venv route.
#
# Without a GPU (nvidia-smi missing, failing or listing none) it installs nothing and exits 2,
# unless --dry-run: that prints every command it would run and runs the resolver check
# (venv route: scripts/check_gpu_requirements.sh; container route: pip install --dry-run with the
# container's constraints). Exit status: 0 done / the dry run's check passed; 1 a step failed;
# 2 usage or refused; 3 no Python 3.12; 4 the package registry could not be reached (dry run).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/env_lib.sh
. "$here/scripts/env_lib.sh"

say() { echo "[setup-gpu] $*"; }
fail() {
  echo "[setup-gpu] FAIL: $*" >&2
  exit 1
}
refuse() {
  echo "[setup-gpu] $*" >&2
  exit 2
}
usage_error() {
  refuse "$* (usage: bash scripts/setup_gpu_env.sh [--dry-run] [--no-resolve] [--system]" \
    "[--requirements FILE] [VENV])"
}

dry=0 resolve=1 system=0 venv="" reqs=""
while (($#)); do
  case $1 in
  --dry-run) dry=1 ;;
  --no-resolve) resolve=0 ;;
  --system) system=1 ;;
  --requirements)
    (($# >= 2)) || usage_error "--requirements: needs a file"
    [[ -f $2 ]] || usage_error "--requirements: $2: no such file"
    reqs=$(realpath "$2")
    shift
    ;;
  -h | --help)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
    ;;
  -*) usage_error "unknown option $1" ;;
  *)
    [[ -z $venv ]] || usage_error "one VENV only (got $venv and $1)"
    venv=$(realpath -m "$1")
    ;;
  esac
  shift
done
((system && ${#venv})) && usage_error "--system installs into this Python: give no VENV"
((resolve || dry)) || usage_error "--no-resolve goes with --dry-run (a real install always resolves)"
reqs=${reqs:-$here/requirements/gpu.txt}
venv=${venv:-$here/.venv-gpu}
cd "$here"
gpu_reqs() { python3 scripts/gpu_requirements.py "$@"; } # stdlib only: any Python 3 reads the file
te_ext=$(gpu_reqs source-build transformer-engine-torch "$reqs") || exit 2
mcore=$(grep -E '^megatron-core==' "$reqs" | sed 's/^megatron-core==//; s/[[:space:]].*//') || true
[[ -n $mcore ]] || refuse "$reqs: no megatron-core==VERSION line"

# -- what is this machine ---------------------------------------------------------------------
if [[ $(uname -s) != Linux || $(uname -m) != x86_64 ]]; then
  refuse "this machine is $(uname -s) $(uname -m); the GPU environment is for Linux x86-64"
fi
gpus=""
if ! command -v nvidia-smi >/dev/null; then
  why="nvidia-smi is not on PATH (no NVIDIA driver here)"
elif ! smi=$(nvidia-smi -L 2>&1); then
  why="nvidia-smi -L failed: ${smi##*$'\n'}"
elif ! gpus=$(grep -c '^GPU ' <<<"$smi"); then
  why="nvidia-smi -L lists no GPU"
  gpus=""
fi
if [[ -z $gpus ]]; then
  if ((!dry)); then
    refuse "no GPU here: $why. This installs CUDA builds for a GPU node: run it on one (e.g." \
      "srun --nodes=1 --gpus-per-node=1 bash scripts/setup_gpu_env.sh), or add --dry-run to" \
      "print the plan and check that the pins resolve"
  fi
  say "dry run on a machine without a GPU ($why): nothing is installed"
else
  say "$gpus GPU(s): $(head -n1 <<<"$smi")"
fi

# run CMD...: print it, and run it unless this is a dry run.
run() {
  local cmd
  cmd=$(printf '%q ' "$@")
  printf '  + %s\n' "${cmd% }"
  ((dry)) || "$@"
}

import_check() { # PYTHON WANT_VLLM WANT_TE (0/1 each)
  "$1" - "$mcore" "$2" "$3" <<'PY'
import importlib.metadata as md
import sys

mcore, want_vllm, want_te = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
fails = []
try:
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        print(f"  torch {torch.__version__} (CUDA {torch.version.cuda}): "
              f"{torch.cuda.device_count()} GPU(s), {name}")
    else:
        fails.append(f"torch {torch.__version__} (CUDA build {torch.version.cuda}) sees no GPU: "
                     "torch.cuda.is_available() is False (driver too old for this CUDA? "
                     "CUDA_VISIBLE_DEVICES empty? not on a GPU node?)")
except Exception as e:
    fails.append(f"import torch: {type(e).__name__}: {e}")
if want_te:
    try:
        import transformer_engine.pytorch  # noqa: F401

        print(f"  transformer_engine {md.version('transformer-engine')} (PyTorch extension imports)")
    except Exception as e:
        fails.append(f"import transformer_engine.pytorch: {type(e).__name__}: {e}")
if want_vllm:
    try:
        import vllm

        print(f"  vllm {vllm.__version__}")
    except Exception as e:
        fails.append(f"import vllm: {type(e).__name__}: {e}")
try:
    import megatron.core  # noqa: F401

    got = md.version("megatron-core")
    if got != mcore:
        fails.append(f"megatron-core is {got}, requirements pin {mcore}")
    else:
        print(f"  megatron-core {got}")
except Exception as e:
    fails.append(f"import megatron.core: {type(e).__name__}: {e}")
try:
    import megatron_ba

    print(f"  megatron_ba {megatron_ba.__version__} from {megatron_ba.__file__}")
except Exception as e:
    fails.append(f"import megatron_ba: {type(e).__name__}: {e}")
for f in fails:
    print(f"[setup-gpu] FAIL: {f}", file=sys.stderr)
sys.exit(1 if fails else 0)
PY
}

export PIP_DISABLE_PIP_VERSION_CHECK=1
# -- container route --------------------------------------------------------------------------
if ((system)); then
  read -r -a cpy <<<"${PYTHON:-python3}"
  pyver=$("${cpy[@]}" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) ||
    refuse "--system: ${cpy[*]} does not run (set PYTHON to the container's interpreter)"
  [[ $pyver == 3.12 ]] || refuse "--system: ${cpy[*]} is Python $pyver; the pins of $reqs are" \
    "for Python 3.12 (megatron-core 0.19 needs >= 3.12): use a container whose Python is 3.12," \
    "or the venv route"
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/setup-gpu.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  "${cpy[@]}" -m pip list --format=json --disable-pip-version-check >"$tmp/installed.json" ||
    fail "--system: ${cpy[*]} -m pip list failed"
  say "container route: $(command -v "${cpy[0]}") (Python $pyver)"
  "${cpy[@]}" scripts/gpu_requirements.py container-plan "$tmp/installed.json" \
    "$tmp/requirements.txt" "$tmp/constraints.txt" "$reqs" | sed 's/^/  note: /' ||
    exit 2
  say "constraints (the container's builds, kept): $(paste -sd' ' "$tmp/constraints.txt")"
  say "to install: $(paste -sd' ' "$tmp/requirements.txt")"
  want_vllm=0
  grep -q '^vllm==' "$tmp/requirements.txt" && want_vllm=1
  grep -q -i '"name": *"vllm"' "$tmp/installed.json" && want_vllm=1 # the container's own
  want_te=0
  grep -q -i '"name": *"transformer.engine' "$tmp/installed.json" && want_te=1
  pip_install=("${cpy[@]}" -m pip install --only-binary=:all: -c "$tmp/constraints.txt"
    -r "$tmp/requirements.txt")
  if ((dry)); then
    say "would run:"
    run "${pip_install[@]}"
    run "${cpy[@]}" -m pip install --no-deps -e .
    say "then the import check (torch sees a GPU, megatron-core $mcore imports$( ((want_te)) &&
      echo ", transformer_engine.pytorch imports")$( ((want_vllm)) && echo ", vllm imports"))"
    ((resolve)) || exit 0
    say "pip's resolver on that (nothing is installed):"
    # fast-deps reads wheel metadata through range requests (see check_gpu_requirements.sh);
    # a pip without the feature resolves with whole downloads.
    if ! "${pip_install[@]}" --dry-run --use-feature=fast-deps >"$tmp/pip.log" 2>&1; then
      if grep -q "fast-deps" "$tmp/pip.log" && grep -q "invalid choice" "$tmp/pip.log"; then
        "${pip_install[@]}" --dry-run >"$tmp/pip.log" 2>&1 && ok=1 || ok=0
      else
        ok=0
      fi
    else
      ok=1
    fi
    grep -v -E -e "^WARNING: Location 'file://|lazily downloaded|fast-deps" \
      -e "^\s*(━|Collecting|Obtaining|Downloading|Processing|Requirement already|Using cached)" \
      "$tmp/pip.log" | tail -n 30 || true
    ((ok)) || fail "--system: pip cannot install that into this Python without changing the" \
      "container's kept packages, or a pin does not resolve (pip's reason above)"
    say "ok: resolves in this Python, the container's builds kept"
    exit 0
  fi
  run "${pip_install[@]}" || fail "installing into the container's Python (pip's reason above)"
  run "${cpy[@]}" -m pip install --no-deps -e . || fail "pip install --no-deps -e ."
  say "import check:"
  import_check "${cpy[0]}" "$want_vllm" "$want_te" || fail "the import check (above)"
  say "done: the container's Python holds the project; launch with CONTAINER=<this image>" \
    "(slurm/README.md)"
  exit 0
fi

# -- venv route -------------------------------------------------------------------------------
py=$(find_python 3.12) || exit 3
if [[ -e $venv || -L $venv ]]; then
  [[ -f $venv/pyvenv.cfg && -x $venv/bin/python ]] ||
    refuse "$venv exists and is not a virtual environment: remove it or give another VENV"
  have=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) ||
    have="?"
  [[ $have == 3.12 ]] || refuse "$venv is a Python $have virtual environment, not 3.12:" \
    "remove it or give another VENV"
  say "updating the Python 3.12 virtual environment $venv"
else
  say "creating $venv with $("$py" --version) ($py)"
fi
((dry)) && say "would run:"
[[ -e $venv ]] || run "$py" -m venv "$venv"
vpy=$venv/bin/python
run "$vpy" -m pip install -q -r requirements/pip.txt || fail "installing pip into $venv"
run "$vpy" -m pip install --only-binary=:all: -r "$reqs" || fail "pip install -r $reqs (above)"
if ((!dry)); then
  if command -v nvcc >/dev/null; then
    say "nvcc: $(nvcc --version | tail -n1) (CUDA_HOME=${CUDA_HOME:-unset})"
  else
    say "no nvcc on PATH: TE's setup.py then needs its prebuilt wheel; a compile would fail" \
      "(load a CUDA 13 toolkit module, or set CUDA_HOME)"
  fi
fi
run "$vpy" -m pip install --no-build-isolation -c "$reqs" "$te_ext" ||
  fail "building Transformer Engine's PyTorch extension ($te_ext) against the installed torch"
run "$vpy" -m pip install --no-deps -e . || fail "pip install --no-deps -e ."
if ((dry)); then
  say "then the import check (torch sees a GPU, transformer_engine.pytorch and vllm import," \
    "megatron-core $mcore)"
  ((resolve)) || exit 0
  say "the resolver check on $reqs:"
  exec bash scripts/check_gpu_requirements.sh "$reqs"
fi
say "import check:"
import_check "$vpy" 1 1 || fail "the import check (above)"
say "done: $venv. Launch: sbatch slurm/grpo_balanced.sh RECIPE (the launcher finds .venv-gpu;" \
  "PYTHON=$vpy for another VENV)"
