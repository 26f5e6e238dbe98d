#!/usr/bin/env bash
# Does the GPU cluster environment resolve? pip's resolver on requirements/gpu.txt, nothing installed.
#
#   bash scripts/check_gpu_requirements.sh [--report OUT.json] [REQUIREMENTS]
#
# REQUIREMENTS defaults to requirements/gpu.txt. Runs, under a Python 3.12 interpreter
# (find_python 3.12, scripts/env_lib.sh) on this Linux x86-64 machine, i.e. for the clusters'
# target,
#   pip install --dry-run --ignore-installed --only-binary=:all: --report R.json -r REQUIREMENTS
# then checks the report (scripts/gpu_requirements.py check-report): every pin resolved at its
# version, torch's CUDA line, Transformer Engine's core package on that same line, one TE release.
# Transformer Engine's PyTorch extension is a source distribution built at install time
# (scripts/setup_gpu_env.sh): it is not a line of the file, so this binary-only check leaves it out.
#
# Exit status: 0 resolves and passes; 1 pip found no solution or a check failed (the reason is
# printed); 2 usage, or not Linux x86-64; 3 no Python 3.12 interpreter; 4 the package registry
# could not be reached (a probe of the first pin failed on a network error).
#
# Download size: the registry serves no PEP 658 metadata files, so plain pip fetches every wheel
# whole (2.95 GB for requirements/gpu.txt); --use-feature=fast-deps makes it read each wheel's
# METADATA through HTTP range requests instead. Measured on a 2-core machine (2026-12-01), empty
# caches: 95 MB in all (resolver venv 2 MB, probe 2.5 MB, resolution 91 MB), 33 s; pip's cache
# keeps none of it, so a second run reads 93 MB again (27 s). The pip that runs is
# requirements/pip.txt's, in a small venv kept in env_lib's cache, so every machine runs the same
# resolver.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/env_lib.sh
. "$here/scripts/env_lib.sh"

say() { echo "[check-gpu-reqs] $*" >&2; }
usage_error() {
  say "$*"
  say "usage: bash scripts/check_gpu_requirements.sh [--report OUT.json] [REQUIREMENTS]"
  exit 2
}

report="" reqs=""
while (($#)); do
  case $1 in
  --report)
    (($# >= 2)) || usage_error "--report: needs a file path"
    report=$(realpath -m "$2")
    shift 2
    ;;
  -h | --help)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
    ;;
  -*) usage_error "unknown option $1" ;;
  *)
    [[ -z $reqs ]] || usage_error "one REQUIREMENTS file only (got $reqs and $1)"
    [[ -f $1 ]] || usage_error "REQUIREMENTS: $1: no such file"
    reqs=$(realpath "$1")
    shift
    ;;
  esac
done
reqs=${reqs:-$here/requirements/gpu.txt}
cd "$here"
if [[ $(uname -s) != Linux || $(uname -m) != x86_64 ]]; then
  usage_error "this machine is $(uname -s) $(uname -m): the resolver answers for the machine it" \
    "runs on, and the target is Linux x86-64; run the check on such a machine"
fi
py=$(find_python 3.12) || exit 3

export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip's output minus the notes that say nothing about this check: the machine-level local index
# folders that do not exist, and fast-deps' "experimental" banner.
quiet() { grep -v -e "^Processing /" -e "^WARNING: Location 'file://" -e "lazily downloaded wheels" -e "fast-deps" || true; }
network_error() {
  grep -q -E "NewConnectionError|Failed to establish a new connection|Temporary failure in name \
resolution|Name or service not known|Network is unreachable|Connection refused|ConnectTimeout|\
ProxyError|Max retries exceeded|Could not fetch URL" "$1"
}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/check-gpu-reqs.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# The resolver's venv: Python 3.12 and requirements/pip.txt's pip, nothing else.
env_lock gpu-resolver
venv=$(cached_env_path gpu-resolver "$py" requirements/pip.txt)
if ! env_is_complete "$venv"; then
  say "creating the resolver's venv $venv ($("$py" --version), $(grep -v '^#' requirements/pip.txt))"
  env_start "$venv" "$py"
  # --retries 1: pip names the network error only when it retries (not with PIP_RETRIES=0)
  if ! "$venv/bin/python" -m pip install --retries 1 -r requirements/pip.txt >"$tmp/pip.log" 2>&1; then
    quiet <"$tmp/pip.log" | tail -n 15 >&2
    if network_error "$tmp/pip.log"; then
      say "SKIP: the package registry cannot be reached (installing pip failed on a network error)"
      exit 4
    fi
    say "FAIL: could not install requirements/pip.txt into $venv"
    exit 1
  fi
  env_finish "$venv"
fi
exec 9>&-  # env_lock's lock: held while the venv is made, not while resolving (runs may overlap)
pip=("$venv/bin/python" -m pip install --dry-run --ignore-installed --only-binary=:all:
  --use-feature=fast-deps)

# Is the registry there? One pin, no dependencies: a network error here is "unreachable" (skip);
# any other failure is left to the full run below, which says what it is.
probe=$(grep -m1 -E '^[A-Za-z0-9]' "$reqs" | sed 's/[[:space:]]*#.*//')
[[ -n $probe ]] || usage_error "REQUIREMENTS: $reqs has no requirement line"
if ! "${pip[@]}" --retries 1 --no-deps "$probe" >"$tmp/probe.log" 2>&1 &&
  network_error "$tmp/probe.log"; then
  quiet <"$tmp/probe.log" | tail -n 15 >&2
  say "SKIP: the package registry cannot be reached (resolving $probe failed on a network error)"
  exit 4
fi

say "resolving $reqs with $("$venv/bin/python" -m pip --version | cut -d' ' -f1-2) under" \
  "$("$py" --version) (binary wheels only; nothing is installed)"
out=${report:-$tmp/report.json}
start=$SECONDS
if ! "${pip[@]}" --report "$out" -r "$reqs" >"$tmp/pip.log" 2>&1; then
  quiet <"$tmp/pip.log" | grep -v -E "^\s*(Obtaining|Collecting|Downloading|Using cached)" |
    tail -n 30 >&2
  say "FAIL: pip's resolver found no set of binary wheels that satisfies $reqs for Python 3.12" \
    "on Linux x86-64 (pip's reason above)"
  exit 1
fi
if ! "$venv/bin/python" scripts/gpu_requirements.py check-report "$out" "$reqs"; then
  say "FAIL: $reqs resolves, but not to the environment it pins (above)"
  exit 1
fi
say "ok: $reqs resolves ($((SECONDS - start)) s)${report:+; report in $report}"
