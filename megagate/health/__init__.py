"""Cluster health: where each rank is (progress), a hang watchdog, one-rank failures, lost peers, straggler and slowdown
reports.

config     the `watchdog` and `straggler` config sections
progress   the trainer's phase markers (the hot path: no I/O, no collective)
channel    the side channel: small files per rank in the run folder, health.jsonl
stacks     the main thread seen from another thread; all-thread stack dumps
diagnosis  which ranks a hung job waits for (pure)
straggler  per-rank compute against the median of the others; the windows (pure)
arrival    who the others wait for: the last to enter the gradient reduction and what it cost (pure)
slowdown   the job's step against its own early steps, the phase that grew (pure)
lost       the line for a rank that vanished (killed) (pure)
watchdog   the thread: progress records, limits, stack dumps, the diagnosis, the exit; a lost peer's exit
"""
