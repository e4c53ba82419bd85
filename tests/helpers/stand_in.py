"""A stand-in for `megagate train` in the Slurm tests: real gloo ranks, a step counter checkpoint, the signal protocol.

    python stand_in.py --config CFG out=DIR [steps=N] [step_time=S] [step_time_restarted=S]
                       [kill_rank=R kill_step=K] [fail_rank=R fail_step=K]

`output.dir=DIR` and `train.train_steps=N` (the trainer's keys, which `megagate submit` validates) mean the same as
`out=DIR` and `steps=N`.

Every step all-reduces (rank + 1 + step) and adds the sum to a running "weight", so the final weight is a
checksum of exactly which steps ran: a replayed or skipped step after a restart changes it. Rank 0 checkpoints
{step, weight} after every step (temp file + os.replace). SIGUSR1/SIGTERM set a flag; the ranks agree on it with
an all-reduce (MAX) at the next step, checkpoint and exit 0, as the trainer will.
kill_rank/kill_step: that rank SIGKILLs itself at that step on the first attempt only (SLURM_RESTART_COUNT unset/0).
fail_rank/fail_step: that rank exits with code 3 at that step on every attempt.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

stop_requested = False


def _on_signal(signum: int, frame: object) -> None:
    global stop_requested
    stop_requested = True


# First thing, before the slow imports: a warning that arrives during start-up must not kill the rank.
signal.signal(signal.SIGUSR1, _on_signal)
signal.signal(signal.SIGTERM, _on_signal)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megagate.distributed.launch import init_process_group  # noqa: E402


def _atomic_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    opts = dict(a.split("=", 1) for a in argv if "=" in a and not a.startswith("--"))
    out = Path(opts.get("out") or opts["output.dir"])
    steps = int(opts.get("steps") or opts.get("train.train_steps") or "10")
    step_time = float(opts.get("step_time", "0.1"))
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    if restart:
        step_time = float(opts.get("step_time_restarted", step_time))

    env = init_process_group("gloo")
    rank = env.rank
    ckpt = out / "ckpt.json"
    state = json.loads(ckpt.read_text()) if ckpt.exists() else {"step": 0, "weight": 0}
    start = state["step"]
    weight = state["weight"]
    record = {
        "rank": rank,
        "world_size": env.world_size,
        "local_rank": env.local_rank,
        "node_rank": env.node_rank,
        "slurm_nodeid": os.environ.get("SLURM_NODEID"),
        "master_port": env.master_port,
        "source": env.source,
        "restart": restart,
        "start_step": start,
        "sums": [],
    }
    step = start
    signalled = False
    while step < steps:
        flag = torch.tensor([1 if stop_requested else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            signalled = True
            break
        if int(opts.get("kill_rank", -1)) == rank and int(opts.get("kill_step", -1)) == step and restart == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if int(opts.get("fail_rank", -1)) == rank and int(opts.get("fail_step", -1)) == step:
            print(f"stand_in: rank {rank} fails on purpose at step {step}", flush=True)
            return 3
        t = torch.tensor([float(rank + 1 + step)])
        dist.all_reduce(t)
        weight += int(t.item())
        record["sums"].append(int(t.item()))
        step += 1
        if rank == 0:
            _atomic_json(ckpt, {"step": step, "weight": weight})
            _atomic_json(out / "progress.json", {"step": step, "restart": restart})
        time.sleep(step_time)
    dist.barrier()
    record.update(end_step=step, weight=weight, signalled=signalled)
    _atomic_json(out / f"rank{rank}-attempt{restart}.json", record)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
