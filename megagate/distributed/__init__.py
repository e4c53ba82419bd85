"""Parallel layout arithmetic (layout), process groups and megatron's parallel state (parallel), rank environments of
torchrun and srun (launch), child processes that die with their parent and ignore stop signals (children),
megatron-core on CPU (megatron_cpu), and rank helpers that also work without a process
group (utils: imported by every layer, torch only)."""
