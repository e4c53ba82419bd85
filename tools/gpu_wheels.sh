#!/usr/bin/env bash
# `make gpu-wheels`: the wheels tools/gpu_acceptance.sh installs on a GPU machine that lacks them, into a fresh .whl/.
#
# Exactly the packages that machine misses (megatron-core today), at the versions requirements.txt pins, for its
# Python 3.12 on x86-64 Linux, without dependencies (torch, numpy and the rest are there). Plain `pip download` from
# any python3 with pip (PYTHON=... to choose), no bootstrap. The new wheels replace .whl/ only once all are in, so
# .whl/ never holds two versions of one package (the install would refuse them) nor a half-made set.
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(megatron-core)
python=${PYTHON:-python3}
specs=()
for name in "${packages[@]}"; do
  spec=$(grep -E "^${name}==" requirements.txt | cut -d' ' -f1)
  [ -n "$spec" ] || { echo "gpu-wheels: error: requirements.txt pins no version of $name" >&2; exit 2; }
  specs+=("$spec")
done
new=$(mktemp -d .whl.new.XXXXXX)
trap 'rm -rf "$new"' EXIT
"$python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$new" "${specs[@]}"
rm -rf .whl
mv "$new" .whl
chmod 755 .whl
trap - EXIT
total=0
for wheel in .whl/*.whl; do
  size=$(stat -c %s "$wheel")
  total=$((total + size))
  awk -v n="$(basename "$wheel")" -v s="$size" 'BEGIN { printf "%s  %.1f MiB\n", n, s / 1048576 }'
done
awk -v s="$total" 'BEGIN { printf "total %.1f MiB in .whl/ (carried with the tree: keep tree + wheels under 64 MiB)\n", s / 1048576 }'
