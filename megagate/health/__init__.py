"""Cluster health: where each rank is (progress), a hang watchdog, one-rank failures, straggler reports.

config     the `watchdog` and `straggler` config sections
progress   the trainer's phase markers (the hot path: no I/O, no collective)
channel    the side channel: small files per rank in the run folder, health.jsonl
stacks     the main thread seen from another thread; all-thread stack dumps
diagnosis  which ranks a hung job waits for (pure)
straggler  per-rank compute against the median of the others (pure)
watchdog   the thread: progress records, limits, stack dumps, the diagnosis, the exit
"""
