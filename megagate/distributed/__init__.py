"""Parallel layout arithmetic (layout), process groups and megatron's parallel state (parallel), rank environments of
torchrun and srun (launch), and megatron-core on CPU (megatron_cpu)."""
