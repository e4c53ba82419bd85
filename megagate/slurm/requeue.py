"""The requeue protocol's bash, the end of every rendered batch script (megagate.slurm.render; slurm/README.md).

The shell runs the step in the background, forwards the time-limit warning to it (srun: USR1 to every rank;
torchrun: TERM through scancel), and after the step decides: a clean exit ends the job, a stop checkpoint or a
failed step requeues it, up to `max_restarts` times, or fewer when the step failed `max_same_failures` times in a row
the same way (the attempts file under the run directory's STATE_SUBDIR); hosts blamed for hangs are excluded.
"""

from __future__ import annotations

import shlex

STATE_SUBDIR = "slurm-state"

_REQUEUE = r"""
# ---- requeue protocol ----
RESTARTS=${SLURM_RESTART_COUNT:-0}
STATE_DIR="$MEGAGATE_RUN_DIR/@STATE_SUBDIR@"
mkdir -p "$STATE_DIR"
FAILURES="$STATE_DIR/job-${SLURM_JOB_ID}.attempts"   # one line per ended attempt: restart, exit code, key, reason, hosts
STEP_ERR="$STATE_DIR/job-${SLURM_JOB_ID}.step.err"    # srun's own messages of the latest attempt
EXCLUDED="$STATE_DIR/job-${SLURM_JOB_ID}.excluded"    # hosts this job no longer runs on, one a line
# the trainer writes why this attempt failed here (kind=, hosts=, reason= lines; megagate.health)
export MEGAGATE_FAILURE_FILE="$STATE_DIR/job-${SLURM_JOB_ID}.failure"
rm -f "$MEGAGATE_FAILURE_FILE"
echo "megagate-slurm: job ${SLURM_JOB_ID} attempt $((RESTARTS + 1)) (restart ${RESTARTS} of ${MEGAGATE_MAX_RESTARTS}) on ${SLURM_JOB_NODELIST} at $(date -Is)"

requeue() {
    # Slurm ends this script while requeueing. ExcNodeList can only change once the job is pending again, and a
    # plainly requeued job may be started again (on the bad host) before the update lands: so a job with excluded
    # hosts is requeued held, updated, then released (a user hold: the owner may release it). TERM is ignored for
    # these three calls, Slurm's KillWait covers them.
    if [[ -s "$EXCLUDED" ]]; then
        trap '' TERM
        scontrol requeuehold "$SLURM_JOB_ID" \
            || { echo "megagate-slurm: scontrol requeuehold ${SLURM_JOB_ID} failed" >&2; exit 1; }
        scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$(sort -u "$EXCLUDED" | paste -sd, -)" \
            || echo "megagate-slurm: could not set ExcNodeList of job ${SLURM_JOB_ID}" >&2
        scontrol release "$SLURM_JOB_ID" \
            || echo "megagate-slurm: job ${SLURM_JOB_ID} is held: run 'scontrol release ${SLURM_JOB_ID}'" >&2
        trap - TERM
    else
        scontrol requeue "$SLURM_JOB_ID" \
            || { echo "megagate-slurm: scontrol requeue ${SLURM_JOB_ID} failed" >&2; exit 1; }
    fi
    sleep 60   # let Slurm end this attempt; exiting first would look like a finished job
    exit 1
}

if [[ -s "$EXCLUDED" ]]; then
    on_excluded=$(comm -12 <(sort -u "$EXCLUDED") <(scontrol show hostnames "$SLURM_JOB_NODELIST" | sort -u) | paste -sd, -)
    if [[ -n "$on_excluded" ]]; then
        if (( RESTARTS >= MEGAGATE_MAX_RESTARTS )); then
            echo "megagate-slurm: giving up: this attempt runs on excluded host(s) $on_excluded and the job already restarted ${RESTARTS} times" >&2
            exit 1
        fi
        echo "megagate-slurm: this attempt landed on excluded host(s) $on_excluded; requeueing job ${SLURM_JOB_ID} without them"
        requeue
    fi
fi

signalled=0
step_pid=""
PROGRESS_FILE=@PROGRESS_FILE@   # the trainer's latest-checkpoint marker, if known (see failure_key)
SIGNAL_EXIT_OK=@SIGNAL_EXIT_OK@   # 1: a non-zero step exit after the warning is the launcher's, not a failure
on_warning() {
    # Slurm's warning (or `scancel --batch --signal=USR1`): have the trainer checkpoint and exit, then requeue.
    signalled=1
    echo "megagate-slurm: caught SIGUSR1 at $(date -Is); forwarding SIG@FORWARD@ to the training step"
    if [[ -n "$step_pid" ]]; then @FORWARD_CMD@; fi
}
trap on_warning USR1

failure_reason() {
    # How the step failed, as srun reports it, without node and task numbers. srun's report order is racy (the
    # peers of a dead rank fail too, and the culprit may still be exiting when --kill-on-bad-exit terminates it),
    # so the most specific reason wins: an exit code other than 1 > a signal (Segmentation fault, Aborted, Out Of
    # Memory, ...) > Killed > exit code 1 > Terminated. (Slurm ends the rest of a failed step with TERM, then KILL
    # after KillWait: Terminated and Killed are often collateral; exit code 1 is what peers of a dead rank report.)
    local reason
    reason=$(awk '/^srun: error: [^:]+: tasks? [0-9,-]+: / {
            r = $0; sub(/^srun: error: [^:]+: tasks? [0-9,-]+: /, "", r)
            s = (r ~ /^Terminated/) ? 0 : (r == "Exited with exit code 1") ? 1 : (r ~ /^Killed/) ? 2 \
                : (r ~ /^Exited with exit code/) ? 4 : 3
            if (!seen || s > best) { best = s; reason = r; seen = 1 }
        } END { print reason }' "$STEP_ERR" 2>/dev/null)
    echo "${reason:-step exit code $1}"
}

exclude_hung_hosts() {
    # Each host of $1 (comma-separated) blamed for MEGAGATE_EXCLUDE_AFTER_HANGS hangs of this job (the attempts
    # file's fifth column) goes into the exclusion list that the requeue applies.
    (( MEGAGATE_EXCLUDE_AFTER_HANGS > 0 )) || return 0
    local host hangs
    for host in ${1//,/ }; do
        hangs=$(awk -F'\t' -v h="$host" '$3 ~ /^hang on / && ("," $5 ",") ~ ("," h ",")' "$FAILURES" | wc -l)
        if (( hangs >= MEGAGATE_EXCLUDE_AFTER_HANGS )) && ! grep -qx "$host" "$EXCLUDED" 2>/dev/null; then
            echo "$host" >> "$EXCLUDED"
            echo "megagate-slurm: excluding $host from this job: $hangs hangs there (exclude_after_hangs=${MEGAGATE_EXCLUDE_AFTER_HANGS})"
        fi
    done
}

failure_key() {
    # What makes two failures "the same way". With the trainer's progress file: failing again from the same
    # checkpoint (whatever srun's racy reason says); without one: the same reason.
    if [[ -n "$PROGRESS_FILE" ]]; then
        if [[ -f "$PROGRESS_FILE" ]]; then
            echo "no progress past checkpoint $(head -c 200 "$PROGRESS_FILE" | tr -s '\t\n' '  ' | sed 's/ *$//')"
        else
            echo "no checkpoint written yet"
        fi
    else
        echo "$1"
    fi
}

if (( signalled )); then
    rc=0   # warned before the step started: nothing to checkpoint, just requeue
else
    : > "$STEP_ERR"
    # Background + wait: bash runs the USR1 trap only while waiting, not while a foreground child runs.
    @STEP@ 2> >(tee -a "$STEP_ERR" >&2) &
    step_pid=$!
    while kill -0 "$step_pid" 2>/dev/null; do wait "$step_pid"; done
    wait "$step_pid"; rc=$?   # bash keeps the status, so this is the step's even after a trap interrupted wait
fi

if (( rc == 0 && ! signalled )); then
    echo "megagate-slurm: training step finished (exit 0) at $(date -Is)"
    rm -f "$FAILURES" "$STEP_ERR" "$MEGAGATE_FAILURE_FILE" "$EXCLUDED"
    exit 0
fi

if (( signalled )) && [[ $rc -ne 0 && $SIGNAL_EXIT_OK -eq 0 && "$(failure_reason "$rc")" == "User defined signal 1" ]]; then
    # The warning reached ranks that had not installed their handler yet (it can come right at the start of a
    # short job): nothing was lost that a restart does not redo, so this is not a failure of the training.
    reason="the warning signal arrived before the ranks could handle it (step exit code $rc)"
    printf '%s\t%s\t%s\t%s\n' "$RESTARTS" 0 "signalled" "exit code $rc: killed by the warning" >> "$FAILURES"
elif (( signalled && (rc == 0 || SIGNAL_EXIT_OK) )); then
    # torchrun re-raises the forwarded TERM after its workers exit, so its step never ends with 0 here.
    reason="checkpointed and exited after the warning signal (step exit code $rc)"
    printf '%s\t%s\t%s\t%s\n' "$RESTARTS" 0 "signalled" "exit code $rc after the warning" >> "$FAILURES"
else
    why=$(failure_reason "$rc")
    key=$(failure_key "$why")
    hosts=""
    if [[ -s "$MEGAGATE_FAILURE_FILE" ]]; then
        # the trainer's own reason: a hang's diagnosis, or the error of the rank that failed
        kind=$(sed -n 's/^kind=//p' "$MEGAGATE_FAILURE_FILE" | head -n 1)
        hosts=$(sed -n 's/^hosts=//p' "$MEGAGATE_FAILURE_FILE" | head -n 1)
        why=$(sed -n 's/^reason=//p' "$MEGAGATE_FAILURE_FILE" | head -n 1 | cut -c1-2000)
        [[ "$kind" == "hang" ]] && key="hang on $hosts"
    fi
    reason="step failed (exit code $rc: $why)"
    printf '%s\t%s\t%s\t%s\t%s\n' "$RESTARTS" "$rc" "$key" "$why" "$hosts" >> "$FAILURES"
    [[ "$key" == hang\ on\ * ]] && exclude_hung_hosts "$hosts"
    # Consecutive: the last N attempts all failed with this key (a signalled attempt in between breaks the run).
    same=$(tail -n "$MEGAGATE_MAX_SAME_FAILURES" "$FAILURES" \
        | awk -F'\t' -v k="$key" '$2 != 0 && $3 == k' | wc -l)
    if (( same >= MEGAGATE_MAX_SAME_FAILURES )); then
        detail="$key"
        [[ "$key" != "$why" ]] && detail="$key; last: $why"
        echo "megagate-slurm: giving up: the training step failed ${same} times the same way ($detail); not requeueing. Attempts: $FAILURES" >&2
        exit 1
    fi
fi

if (( RESTARTS >= MEGAGATE_MAX_RESTARTS )); then
    echo "megagate-slurm: giving up: $reason, and the job already restarted ${RESTARTS} times (max_restarts=${MEGAGATE_MAX_RESTARTS}); not requeueing" >&2
    exit 1
fi
excluding=""
[[ -s "$EXCLUDED" ]] && excluding=" excluding $(sort -u "$EXCLUDED" | paste -sd, -)"
echo "megagate-slurm: $reason; requeueing job ${SLURM_JOB_ID} (restart $((RESTARTS + 1)) of ${MEGAGATE_MAX_RESTARTS})${excluding} at $(date -Is)"
# the next attempt starts from the top with SLURM_RESTART_COUNT + 1
requeue
"""


_FORWARD_CMD = {
    # srun passes USR1 on to every task.
    "srun": 'kill -s USR1 "$step_pid" 2>/dev/null || true',
    # srun would treat TERM as "cancel the step" (SIGKILL after KillWait); scancel signals the step's tasks
    # (the torchrun agents) directly, and torchrun passes TERM on to its workers (giving them 30 s).
    "torchrun": 'scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || true',
}


def requeue_protocol(launcher: str, step: str, forward: str, progress_file: str | None) -> str:
    """The protocol for `launcher` around the step command `step` (forwarding the warning as signal `forward`)."""
    return (
        _REQUEUE.replace("@STATE_SUBDIR@", STATE_SUBDIR)
        .replace("@FORWARD_CMD@", _FORWARD_CMD[launcher])
        .replace("@FORWARD@", forward)
        .replace("@PROGRESS_FILE@", shlex.quote(progress_file or ""))
        .replace("@SIGNAL_EXIT_OK@", "1" if launcher == "torchrun" else "0")
        .replace("@STEP@", step)
    )
