#!/usr/bin/env bash
# Install the Slurm daemons, clients and munge for the local test cluster (Debian 12: Slurm 22.05).
# Idempotent: does nothing when every binary is already present. The packages do not start services;
# slurm/local/cluster.py starts the daemons itself under a state folder.
set -euo pipefail

need=(slurmctld slurmd sbatch srun scontrol squeue scancel munged)
missing=0
for b in "${need[@]}"; do
    command -v "$b" >/dev/null 2>&1 || missing=1
done
if [[ $missing -eq 0 ]]; then
    echo "slurm/local/install.sh: Slurm and munge already installed (Slurm $(dpkg-query -W -f='${Version}' slurmctld 2>/dev/null || echo ?))"
    exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
    SUDO=sudo
else
    SUDO=
fi
export DEBIAN_FRONTEND=noninteractive
# Package lists may be missing on a fresh image; one update first, then a plain install.
if ! apt-cache show slurmctld >/dev/null 2>&1; then
    $SUDO apt-get update -q
fi
$SUDO apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge
echo "slurm/local/install.sh: installed Slurm $(dpkg-query -W -f='${Version}' slurmctld 2>/dev/null || echo ?)"
