#!/usr/bin/env bash
# One-shot GPU acceptance (issue 10): `bash tools/gpu_acceptance.sh [OUT_DIR] [gpu_acceptance.py options]`.
# Made for a bare GPU machine with torch but without megatron-core, TE, apex, DALI or network: megatron-core comes
# as a wheel carried in .whl/ (make it here with `make gpu-wheels`) and is installed into /tmp, never into the
# machine's environment. Everything it measures lands in OUT_DIR/gpu_acceptance.json (OUT_DIR defaults to $OUT,
# the device tool's result folder, else runs/gpu_acceptance). The whole run is capped at 470 s.
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir="${1:-${OUT:-runs/gpu_acceptance}}"
[ $# -gt 0 ] && shift
python=${PYTHON:-python3}
if ! "$python" -c "import megatron.core" 2>/dev/null; then
  wheels=(.whl/megatron_core-*.whl)
  if [ ! -e "${wheels[0]}" ]; then
    echo "gpu_acceptance: error: megatron-core is not installed and no .whl/megatron_core-*.whl was carried (run 'make gpu-wheels' and carry .whl)" >&2
    exit 2
  fi
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/megagate-site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/megagate-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
[ -n "${PYTORCH_ALLOC_CONF:-}${PYTORCH_CUDA_ALLOC_CONF:-}" ] || export PYTORCH_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true
exec timeout 470 "$python" tools/gpu_acceptance.py --out "$out_dir" "$@"
