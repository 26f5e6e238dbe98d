# shellcheck shell=bash
# Shared by the scripts/setup_*_env.sh scripts (sourced, not run): find an interpreter, and keep
# each virtual environment in a cache outside the checkout, keyed by the hash of its inputs.
#
#   . scripts/env_lib.sh
#   py=$(find_python 3.12)                    # fails loudly when no 3.12 interpreter is found
#   env=$(cached_env_path current "$py" requirements/current.txt scripts/setup_current_env.sh)
#   if env_is_complete "$env"; then ...; else env_start "$env" "$py"; ...install...; env_finish "$env"; fi
#   link_env "$env" .venv-current             # the checkout's .venv-current -> the cached folder
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

# env_finish FOLDER: mark the build complete and drop older builds of the same NAME.
env_finish() {
  local dir=$1 old
  touch "$dir/.complete"
  case "$dir" in "$(env_cache_root)"/*) ;; *) return 0 ;; esac  # a folder of the user's own
  for old in "${dir%-*}"-????????????????; do
    [ "$old" = "$dir" ] || [ ! -d "$old" ] && continue
    echo "[env] removing the outdated $old"
    rm -rf "$old"
  done
}

# link_env FOLDER LINK: make LINK (e.g. .venv) a symbolic link to FOLDER. A LINK that is a real
# folder (made by an older set-up that built environments inside the checkout) is replaced.
link_env() {
  local dir=$1 link=$2
  if [ -d "$link" ] && [ ! -L "$link" ]; then
    echo "[env] $link is a folder of an older set-up: replacing it with a link to $dir"
    rm -rf "$link"
  fi
  ln -sfn "$dir" "$link"
}
