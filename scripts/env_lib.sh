# shellcheck shell=bash
# Shared by the scripts/setup_*_env.sh scripts (sourced, not run): find an interpreter, and keep
# each virtual environment in a cache outside the checkout, keyed by the hash of its inputs.
#
#   . scripts/env_lib.sh
#   py=$(find_python 3.12)                    # fails loudly when no 3.12 interpreter is found
#   env=$(cached_env_path current "$py" requirements/current.txt scripts/setup_current_env.sh)
#   if env_is_complete "$env"; then ...; else env_start "$env" "$py"; ...install...; env_finish "$env"; fi
#   checkout_env "$env" .venv-current "$py"   # this checkout's own environment over the cached one
#
# The cache: $MEGATRON_BA_ENV_CACHE, default ${XDG_CACHE_HOME:-$HOME/.cache}/megatron-ba/envs. An
# environment's folder is NAME-<first 16 hex digits of sha256(inputs, interpreter version)>, so a
# second clone on the same machine, or a second CI run, finds it built; a change to any input
# builds a new one (and removes the older folders of that NAME). A folder whose build did not
# finish has no .complete file and is rebuilt from scratch.

env_cache_root() {
  echo "${MEGATRON_BA_ENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron-ba/envs}"
}

# find_python X.Y: the path of a CPython X.Y interpreter, or exit 1 with what was tried.
# Looks at $PYTHON when it is X.Y, then pythonX.Y on PATH, then pyenv's versions.
find_python() {
  local want=$1 cand tried=()
  local candidates=()
  [ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
  candidates+=("python$want")
  if command -v pyenv >/dev/null 2>&1; then
    local root
    root=$(pyenv root 2>/dev/null) && candidates+=("$root"/versions/"$want".*/bin/python"$want")
  fi
  candidates+=("$HOME"/.pyenv/versions/"$want".*/bin/python"$want")
  for cand in "${candidates[@]}"; do
    [ -e "$cand" ] || command -v "$cand" >/dev/null 2>&1 || { tried+=("$cand"); continue; }
    if [ "$("$cand" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "$want" ]; then
      command -v "$cand"
      return 0
    fi
    tried+=("$cand")
  done
  echo "find_python: no Python $want interpreter found (tried: ${tried[*]}); install one" \
    "(e.g. \`pyenv install $want\`) or set PYTHON to its path" >&2
  return 1
}

# cached_env_path NAME PYTHON INPUT_FILE...: the cache folder of that environment (not created).
cached_env_path() {
  local name=$1 py=$2
  shift 2
  local version hash
  version=$("$py" -c 'import sys, platform; print(sys.version, platform.machine())') || return 1
  hash=$({ echo "$version"; cat "$@"; } | sha256sum | cut -c1-16)
  echo "$(env_cache_root)/$name-$hash"
}

# env_lock NAME: hold an exclusive lock on that environment's builds until the calling shell
# exits (two set-ups on one machine at once wait for each other instead of sharing a half-built
# folder).
env_lock() {
  local root
  root=$(env_cache_root)
  mkdir -p "$root"
  exec 9>"$root/.$1.lock"
  flock 9
}

env_is_complete() { [ -f "$1/.complete" ] && [ -x "$1/bin/python" ]; }

# env_start FOLDER PYTHON: a fresh venv in FOLDER (anything left there by a failed build goes).
env_start() {
  local dir=$1 py=$2
  rm -rf "$dir"
  mkdir -p "$(dirname "$dir")"
  "$py" -m venv "$dir"
}

# env_finish FOLDER: mark the build complete and drop older builds of the same NAME made by the
# same interpreter (one made by another interpreter, e.g. /usr/bin/python3.11 beside pyenv's, may
# be what another checkout's environment stands on).
env_finish() {
  local dir=$1 old made_by
  touch "$dir/.complete"
  case "$dir" in "$(env_cache_root)"/*) ;; *) return 0 ;; esac  # a folder of the user's own
  made_by=$(grep -m1 '^executable' "$dir/pyvenv.cfg" 2>/dev/null || true)
  for old in "${dir%-*}"-????????????????; do
    [ "$old" = "$dir" ] || [ ! -d "$old" ] && continue
    [ "$(grep -m1 '^executable' "$old/pyvenv.cfg" 2>/dev/null || true)" = "$made_by" ] || continue
    echo "[env] removing the outdated $old"
    rm -rf "$old"
  done
}

# checkout_env SHARED DIR PYTHON: make DIR (e.g. .venv) this checkout's own environment over the
# cached one. The cached folder SHARED holds the dependencies only; DIR is a small virtual
# environment of its own (made by PYTHON, the interpreter SHARED was built with) whose
# site-packages reads SHARED's (a .pth line) and holds this checkout's editable install, so each
# checkout imports its own code even when several share one cache. SHARED's console scripts
# (torchrun, pytest, ruff, ...) get copies in DIR/bin that run DIR's Python. DIR/shared-env names
# SHARED. A DIR left as a link into the cache by an older set-up is replaced.
checkout_env() {
  local shared=$1 dir=$2 py=$3 site shared_site f name
  if [ -L "$dir" ] || { [ -e "$dir" ] && [ ! -f "$dir/shared-env" ]; }; then
    echo "[env] $dir is from an older set-up (a link into the cache): making it this checkout's own"
    rm -rf "$dir"
  fi
  [ -x "$dir/bin/python" ] || "$py" -m venv --without-pip "$dir"
  dir=$(cd "$dir" && pwd)
  echo "$shared" >"$dir/shared-env"
  site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  shared_site=$("$shared/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # A cache that an older set-up installed some checkout into (editable) serves none of them now.
  if compgen -G "$shared_site/*megatron_ba*" >/dev/null; then
    "$shared/bin/python" -m pip uninstall -q -y megatron-ba >/dev/null 2>&1 || true
    rm -rf "$shared_site"/*megatron_ba* "$shared/bin/megatron-ba"
  fi
  # zz-: read after this checkout's own .pth files, so its code comes first on sys.path.
  echo "import site; site.addsitedir('$shared_site')" >"$site/zz-megatron-ba-shared-env.pth"
  for f in "$shared"/bin/*; do
    name=${f##*/}
    case "$name" in python* | activate* | Activate.ps1 | __pycache__ | megatron-ba) continue ;; esac
    [ -f "$f" ] && [ -x "$f" ] || continue
    rm -f "$dir/bin/$name"
    if head -c 2 "$f" | grep -q '#!' && head -n 3 "$f" | grep -qF "$shared/bin/python"; then
      sed "1,3s|$shared/bin/python|$dir/bin/python|" "$f" >"$dir/bin/$name"
      chmod +x "$dir/bin/$name"
    else
      ln -s "$f" "$dir/bin/$name"  # a binary (ruff) or a script that names no interpreter
    fi
  done
  "$dir/bin/python" -m pip install -q --no-deps -e . 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }
  return "${PIPESTATUS[0]}"
}
