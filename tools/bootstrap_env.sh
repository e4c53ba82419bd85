#!/usr/bin/env bash
# Build (once) or reuse the heavy pinned packages, then give this clone its own cheap environment at ./.venv.
# The heavy environment (torch, megatron-core, ...: several GB) lives outside the clone, keyed by the hash of
# requirements.txt and the Python version, so CI runs and fresh clones on the same machine reuse it; a fresh machine
# builds it. It never holds megagate itself: each clone's .venv (a venv of a few kB, made in seconds) sees the heavy
# packages through a .pth file and has this clone installed editable, so no clone ever runs another clone's code.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

find_python() {
  for cand in "${MEGAGATE_PYTHON:-}" python3.12 /root/.pyenv/versions/3.12.1/bin/python3.12 python3.13 python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  echo "bootstrap: no Python >= 3.12 found (set MEGAGATE_PYTHON=/path/to/python3.12)" >&2
  return 1
}

py=$(find_python)
key=$( { cat requirements.txt; "$py" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
cache=${MEGAGATE_ENV_CACHE:-$HOME/.cache/megagate}
venv="$cache/venv-$key"
mkdir -p "$cache"

if [ ! -f "$venv/.complete" ]; then
  # A half-built environment (interrupted install) is never reused.
  rm -rf "$venv"
  echo "bootstrap: building $venv (torch and megatron-core: several GB, once per machine)" >&2
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip wheel setuptools >&2
  "$venv/bin/python" -m pip install -q -r requirements.txt >&2
  touch "$venv/.complete"
fi

# Older bootstraps installed a clone editable into the shared environment: that install would shadow every other
# clone's code, so it goes.
if [ -n "$(ls "$venv"/lib/python3*/site-packages/ | grep -i '^__editable__.*megagate\|^megagate-.*dist-info$' || true)" ]; then
  "$venv/bin/python" -m pip uninstall -q -y megagate >&2
fi

local_env="$root/.venv"
heavy_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
[ -L "$local_env" ] && rm -f "$local_env"  # the old layout linked the shared environment itself here
if [ ! -x "$local_env/bin/python" ] || ! cmp -s <(echo "$venv") "$local_env/.megagate-heavy-env" 2>/dev/null; then
  rm -rf "$local_env"
  "$py" -m venv --without-pip "$local_env"
  local_site=$("$local_env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$heavy_site" > "$local_site/megagate-heavy-env.pth"
  # The heavy environment's commands (torchrun, pytest, tensorboard, ...), run by this clone's interpreter; native
  # executables (ruff) are linked.
  for script in "$venv"/bin/*; do
    name=$(basename "$script")
    case "$name" in python*|pip*|activate*|Activate.ps1|megagate) continue ;; esac
    if head -c 2 "$script" | grep -q '#!'; then
      { echo "#!$local_env/bin/python"; tail -n +2 "$script"; } > "$local_env/bin/$name"
      chmod +x "$local_env/bin/$name"
    else
      ln -sfn "$script" "$local_env/bin/$name"
    fi
  done
  echo "$venv" > "$local_env/.megagate-heavy-env"
fi
# This clone, editable (seconds), so the entry point follows the checkout. pip runs from the heavy environment and
# installs into this clone's. (PYTHONWARNINGS: setuptools warns on every editable build that a folder named like
# the package may shadow it.)
PYTHONWARNINGS=ignore "$venv/bin/python" -m pip --python "$local_env/bin/python" install -q --no-deps \
  --no-build-isolation -e "$root" >&2
echo "$local_env"
