#!/usr/bin/env bash
# GPU acceptance in one command: `bash tools/gpu_acceptance.sh [OUT_DIR] [gpu_acceptance.py options]`.
#
# The machine it needs: one GPU with python3, torch and CUDA, without megatron-core, Transformer Engine, apex, DALI
# or network. megatron-core comes as a wheel carried in .whl/ (make it where pip reaches PyPI: `make gpu-wheels`);
# gpu_acceptance.py installs it under /tmp, never into the machine's environment, and writes the JSON even when it
# is missing or does not install. OUT_DIR (default $OUT, else runs/gpu_acceptance) gets at most five small files;
# the last line on stdout is a one-line JSON summary. The parts share a 450 s budget; `timeout` below is only the
# backstop should the script itself hang (it then gets SIGTERM, stops the running part, writes the JSON and the
# summary).
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir="${1:-${OUT:-runs/gpu_acceptance}}"
[ $# -gt 0 ] && shift
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
exec timeout -k 15 "${GPU_ACCEPTANCE_HARD_LIMIT:-520}" "$python" tools/gpu_acceptance.py --out "$out_dir" "$@"
