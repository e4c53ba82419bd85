"""Which ranks a hung job waits for: one line from the ranks' progress records, read twice a few seconds apart.

Pure: records in, a `Diagnosis` out. A rank did not arrive when
- it has no progress record in this launch (it never started, or died before its first record),
- its record did not change between the two reads (stopped, e.g. SIGSTOP, or frozen: it cannot dump its stack), or
- its main thread is not waiting for other ranks (megagate.health.stacks: computing, or blocked on something of
  its own) while the others wait;
and when every rank waits, the ranks behind the others (an earlier step or phase) did not arrive. When nothing
stands out, the line says where the ranks wait (a collective that never completes: the network, a library).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from megagate.health.config import PHASES


@dataclass(frozen=True)
class Diagnosis:
    line: str  # one line: who did not arrive, where the others wait
    culprits: tuple[int, ...]  # ranks that did not arrive
    hosts: tuple[str, ...]  # their hosts
    waiting: tuple[int, ...] = ()
    details: dict = field(default_factory=dict)  # rank -> why

    def to_dict(self) -> dict:
        return {
            "line": self.line,
            "ranks": list(self.culprits),
            "hosts": list(self.hosts),
            "waiting": list(self.waiting),
            "details": {str(k): v for k, v in self.details.items()},
        }


def _position(record: Mapping) -> tuple[int, int]:
    phase = record.get("phase", "setup")
    return int(record.get("step", 0)), PHASES.index(phase) if phase in PHASES else 0


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in ranks)


def _where(record: Mapping) -> str:
    return f"{record.get('phase', '?')} of step {record.get('step', '?')}"


def diagnose(before: Mapping[int, Mapping], after: Mapping[int, Mapping], world_size: int, stacks: str) -> Diagnosis:
    """The diagnosis from two reads of every rank's record (`after` a few heartbeats later than `before`)."""
    missing = [r for r in range(world_size) if r not in after]
    frozen = [r for r in sorted(after) if r in before and before[r].get("beat") == after[r].get("beat")]
    live = [r for r in sorted(after) if r not in frozen]
    busy = [r for r in live if not after[r].get("waiting")]
    waiting = [r for r in live if after[r].get("waiting")]
    details: dict[int, str] = {}
    for r in missing:
        details[r] = "no progress record in this launch (never started, or died before it wrote one)"
    for r in frozen:
        details[r] = f"not responding (stopped or frozen, no stack), last seen in {_where(after[r])}"
    if missing or frozen or busy:
        for r in busy:
            rec = after[r]
            details[r] = f"{_where(rec)} for {rec.get('phase_age', 0):.0f} s, busy in {rec.get('where', '?')}"
    elif waiting and not busy:
        positions = {r: _position(after[r]) for r in waiting}
        lowest = min(positions.values())
        if len(set(positions.values())) > 1:
            for r in waiting:
                if positions[r] == lowest:
                    details[r] = f"behind the others, waiting in {_where(after[r])} ({after[r].get('where', '?')})"
            waiting = [r for r in waiting if r not in details]
    culprits = sorted(details)
    hosts = tuple(dict.fromkeys(str(after.get(r, {}).get("host", "?")) for r in culprits if r in after))
    if culprits:
        parts = [
            f"{_ranks([r])} ({after[r].get('host', '?') if r in after else '?'}) did not arrive: {details[r]}"
            for r in culprits
        ]
    else:
        parts = ["no rank stands out: every rank waits for the others"]
    if waiting:
        groups: dict[tuple, list[int]] = {}
        for r in waiting:
            groups.setdefault((_where(after[r]), after[r].get("where", "?")), []).append(r)
        for (where, frame), ranks in groups.items():
            parts.append(f"{_ranks(ranks)} {'waits' if len(ranks) == 1 else 'wait'} in {where} ({frame})")
    line = "hang: " + "; ".join(parts) + f"; stacks in {stacks}"
    return Diagnosis(line, tuple(culprits), hosts, tuple(waiting), details)


# what a rank's collective raises when another rank's process is gone (gloo's TCP pairs, NCCL's watchdog)
PEER_LOSS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "remote process exited or there was a network error",
)


def lost_a_peer(error: BaseException) -> bool:
    """Whether `error` only says another rank vanished (killed without a word, its node lost): not this rank's fault,
    so it does not speak for the job; the launcher names the rank that died."""
    text = f"{error}"
    return any(marker in text for marker in PEER_LOSS)
