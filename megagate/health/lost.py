"""The line for a rank that vanished mid-run (killed without a word: SIGKILL, the OOM killer, a lost node).

Pure: the ranks' progress records, read twice a few heartbeats apart, in; one line out. A rank vanished when its
process on this host is gone (the caller checks /proc) or its record stopped changing while the other survivors'
kept changing. The line names it, its host, the step and phase its last record held, that the job stops, and the
checkpoint a rerun resumes from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

KILLED = "killed by a signal (the launcher's summary names it; SIGKILL is often the kernel's OOM killer)"


def vanished_line(
    before: Mapping[int, Mapping],
    after: Mapping[int, Mapping],
    gone_here: Sequence[int],
    me: int,
    world_size: int,
    resume_from: str | None,
) -> tuple[str, list[int], list[str]]:
    """(the line, the vanished ranks, their hosts)."""
    ranks = sorted(gone_here)
    if not ranks:
        stale = [r for r in sorted(after) if r != me and r in before and before[r].get("beat") == after[r].get("beat")]
        missing = [r for r in range(world_size) if r not in after and r != me]
        ranks = sorted(set(stale) | set(missing))
    parts = []
    for r in ranks:
        rec = after.get(r) or before.get(r)
        if rec is None:
            parts.append(f"rank {r} vanished before it wrote a progress record")
            continue
        how = KILLED if r in gone_here else "its progress record stopped changing (its process or node is gone)"
        parts.append(
            f"rank {r} ({rec.get('host', '?')}) vanished in {rec.get('phase', '?')} of step {rec.get('step', '?')}: "
            f"{how}"
        )
    if not parts:
        parts.append(
            "another rank closed its connection (no rank's record stopped: a network fault, or a rank exiting)"
        )
    resume = f"a rerun resumes from {resume_from}" if resume_from else "no checkpoint yet: a rerun starts from scratch"
    hosts = [str((after.get(r) or before.get(r) or {}).get("host", "?")) for r in ranks]
    return f"peer lost: {'; '.join(parts)}; the job stops; {resume}", ranks, list(dict.fromkeys(hosts))
