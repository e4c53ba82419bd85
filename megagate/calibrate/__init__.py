"""`megagate calibrate`: measure the machine it runs on and write a device profile for `megagate plan --profile`.

`measure.py` times the kernels (GEMM sweep by shape and dtype, grouped GEMM by tokens per expert, the SDPA and
megatron's local core attention, memory bandwidth), `collectives.py` a small world of local ranks (gloo on CPU, NCCL
on GPUs: collective latency and bandwidth, and how much each rank slows when they share the machine),
`framework.py` the trainer's own overheads (a step of megagate's trainer on tiny models: per step, per micro-batch,
per layer, per gate, per MoE block and local expert), `core.py` runs them within a time budget and fits the profile
(megagate.plan.curves). docs/planning.md, "Calibrating a machine".
"""
