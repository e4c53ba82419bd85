#!/usr/bin/env bash
# Build (once) or reuse the project's Python environment, then link it at ./.venv.
# The environment lives outside the clone, keyed by the hash of requirements.txt and the Python version,
# so CI runs and fresh clones on the same machine reuse it; a fresh machine builds it.
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

ln -sfn "$venv" "$root/.venv"
# The package itself is installed editable from this clone (seconds), so the entry point follows the checkout.
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$root" >&2
echo "$venv"
