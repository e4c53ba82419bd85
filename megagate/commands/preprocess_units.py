"""The sharded modes of `megagate preprocess` (not a command of its own: `megagate.commands.preprocess` calls it).

`--plan-only` writes the manifest and prints units, bytes and an ETA from a measured rate; `--unit K` and
`--task-id K` process units; `--merge` merges them; `--sharded` does all three here; `--slurm` submits the tasks that
have missing units as one job array (megagate.slurm's render + submit) and a merge job that starts after it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from megagate.data import shards
from megagate.data import units as U
from megagate.data.preprocess import check_outputs, output_prefix_for
from megagate.errors import ConfigError

Lines = list[tuple[str, str]]


def run_mode(args: argparse.Namespace, mode: str, spec, opts) -> Lines:
    unit_bytes = _unit_bytes(args.unit_mb)
    if mode in ("merge", "sharded", "slurm") and not args.blend:  # before any unit runs or any job is queued
        check_outputs({k: output_prefix_for(args.output_prefix, k) for k in opts.keys}, args.overwrite)
    if mode in ("plan_only", "sharded", "slurm"):
        manifest = shards.plan(args.input, args.output_prefix, spec, opts, unit_bytes, args.tasks, args.overwrite)
    else:
        manifest = U.read_manifest(U.units_dir(args.output_prefix))
        if manifest["settings"] != shards.settings_of(spec, opts):
            raise ConfigError(
                f"{U.units_dir(args.output_prefix) / U.MANIFEST}: planned with other settings than this command's; "
                "give the plan's settings, or re-plan with --plan-only --overwrite"
            )
    progress = not args.no_progress
    if mode == "plan_only":
        return render_plan(manifest, shards.measure_rate(manifest, spec), opts.workers)
    if mode == "merge":
        return _merge(args)
    if mode in ("unit", "task_id"):
        ids = shards.select_units(manifest, unit=args.unit, task=_task_id(args.task_id))
        return render_units(shards.run_units(args.output_prefix, spec, opts.workers, ids, progress))
    if mode == "sharded":
        lines = render_units(
            shards.run_units(args.output_prefix, spec, opts.workers, shards.select_units(manifest), progress)
        )
        return lines + _merge(args)
    return submit_array(args, manifest)


def _merge(args: argparse.Namespace) -> Lines:
    if args.blend:
        return [
            ("out", f"{key}: blend of the units {path} (data.blend with token counts as weights)")
            for key, path in shards.write_blend(args.output_prefix).items()
        ]
    return render_merge(shards.merge(args.output_prefix, args.overwrite))


def _unit_bytes(unit_mb: float) -> int:
    if not (unit_mb > 0 and unit_mb < 1e9):
        raise ConfigError(f"--unit-mb {unit_mb}: must be a positive number of megabytes")
    return max(1, int(unit_mb * 1e6))


def _task_id(value: str | None) -> int | None:
    if value is None:
        return None
    if value == "env":
        value = os.environ.get("SLURM_ARRAY_TASK_ID")
        if value is None:
            raise ConfigError("--task-id env: SLURM_ARRAY_TASK_ID is not set (not inside a Slurm array task)")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"--task-id {value!r}: must be an integer or env") from None


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def render_plan(manifest: dict[str, Any], rate: dict[str, float], workers: int) -> Lines:
    units, tasks = manifest["units"], manifest["tasks"]
    total = sum(u["bytes"] for u in units)
    lines: Lines = [("out", f"{'unit':>5} {'task':>4} {'MB':>10}  inputs")]
    for u in units[:50]:
        first = Path(u["inputs"][0]["path"]).name
        rg = u["pieces"][0]["row_groups"]
        what = (
            first
            + (f" row groups {rg[0]}..{rg[1] - 1}" if rg else "")
            + (f" +{len(u['pieces']) - 1} more" if len(u["pieces"]) > 1 else "")
        )
        lines.append(("out", f"{u['id']:>5} {u['task']:>4} {u['bytes'] / 1e6:>10.1f}  {what}"))
    if len(units) > 50:
        lines.append(("out", f"... {len(units) - 50} more units"))
    per_task = max(sum(u["bytes"] for u in units if u["task"] == t) for t in range(tasks))
    speed = rate["disk_bytes_per_s"] * max(1, workers)  # one task's W workers; tasks run side by side
    lines.append(
        (
            "out",
            f"plan: {len(units)} units, {tasks} tasks, {total / 1e6:,.1f} MB; measured {rate['tokens_per_s']:,.0f} tokens/s "
            f"({rate['disk_bytes_per_s'] / 1e6:.2f} MB/s) per worker; ETA {_hms(per_task / max(speed, 1e-9))} with "
            f"{tasks} tasks x {max(1, workers)} workers",
        )
    )
    lines.append(("out", f"manifest: {U.units_dir(manifest['output_prefix']) / U.MANIFEST}"))
    return lines


def render_units(records: list[shards.UnitRecord]) -> Lines:
    lines: Lines = []
    for r in records:
        if r.skipped:
            lines.append(("out", f"unit {r.unit}: already done ({r.documents:,} documents, {r.tokens:,} tokens)"))
        else:
            rate = r.tokens / max(r.seconds, 1e-9)
            lines.append(
                (
                    "out",
                    f"unit {r.unit}: {r.documents:,} documents, {r.tokens:,} tokens in {r.seconds:.1f} s ({rate:,.0f} tokens/s)",
                )
            )
        if r.bad_lines:
            lines.append(("err", f"unit {r.unit}: skipped {r.bad_lines:,} bad records"))
    return lines


def render_merge(res: shards.MergeResult) -> Lines:
    gbs = res.bytes_copied / max(res.seconds, 1e-9) / 1e9
    lines: Lines = [
        (
            "out",
            f"merged {len(res.units)} units: {res.documents:,} documents, {sum(res.tokens.values()):,} tokens, "
            f"{res.bytes_copied / 1e6:,.1f} MB in {res.seconds:.2f} s ({gbs:.2f} GB/s)",
        )
    ]
    for key, prefix in res.prefixes.items():
        lines.append(("out", f"{key}: {prefix}.bin / .idx ({res.tokens[key]:,} tokens)"))
    return lines


def _shared_argv(args: argparse.Namespace) -> list[str]:
    """This command's settings as arguments for the jobs (absolute paths: a job may start elsewhere)."""
    argv = ["-m", "megagate", "preprocess", "--input", *[os.path.abspath(p) for p in args.input]]
    argv += ["--output-prefix", os.path.abspath(args.output_prefix), "--tokenizer", os.path.abspath(args.tokenizer)]
    argv += ["--engine", args.engine, "--json-keys", *args.json_keys]
    argv += ["--append-eod" if args.append_eod else "--no-append-eod", "--text-mode", args.text_mode]
    argv += [
        "--bad-lines",
        args.bad_lines,
        "--tiktoken-pattern",
        args.tiktoken_pattern,
        "--chunk-mb",
        str(args.chunk_mb),
    ]
    argv += ["--unit-mb", str(args.unit_mb)]
    if args.eod_token is not None:
        argv += ["--eod-token", args.eod_token]
    if args.workers is not None:
        argv += ["--workers", str(args.workers)]
    return argv


def submit_array(args: argparse.Namespace, manifest: dict[str, Any]) -> Lines:
    """Submit the tasks with missing units as an array, then the merge (after the array, whatever its outcome: the
    merge names the units still missing). Rerunning the same command submits only what is still missing."""
    from megagate.slurm import SlurmRequest, render_batch_script, submit, write_script

    _, missing = shards.missing_units(args.output_prefix)
    tasks = sorted({manifest["units"][i]["task"] for i in missing})
    udir = U.units_dir(args.output_prefix)
    common = dict(
        nodes=1,
        gpus_per_node=0,
        tasks_per_node=1,
        time=args.slurm_time,
        partition=args.slurm_partition,
        account=args.slurm_account,
        python=sys.executable,
        max_restarts=0,  # a failed task is redone by rerunning the command, not requeued in a loop
        run_dir=str(udir / "slurm"),
        log_dir=str(udir / "logs"),
        signal_lead_s=min(60, max(1, _seconds(args.slurm_time) // 2)),
    )
    argv = _shared_argv(args)
    lines: Lines = []
    after: int | None = None
    if tasks:
        limit = f"%{args.slurm_max_parallel}" if args.slurm_max_parallel else ""
        cpus = args.workers if args.workers else None
        request = SlurmRequest(
            job_name="preprocess", array=",".join(map(str, tasks)) + limit, cpus_per_task=cpus, **common
        )
        script = render_batch_script(
            request, [*argv, "--task-id", "env"], header="megagate preprocess: one task's units"
        )
        path = udir / "slurm" / "preprocess-array.sbatch"
        if args.dry_run:
            write_script(script, path)
        else:
            after = submit(request, script, script_path=path)
        lines.append(
            (
                "out",
                f"array: tasks {','.join(map(str, tasks))} ({len(missing)} units) -> {path}"
                + (f" job {after}" if after else ""),
            )
        )
    else:
        lines.append(("out", f"all {len(manifest['units'])} units are done; only the merge is submitted"))
    extra = (f"--dependency=afterany:{after}",) if after else ()
    request = SlurmRequest(job_name="preprocess-merge", extra_sbatch=extra, **common)
    merge_argv = [*argv, "--merge"] + (["--overwrite"] if args.overwrite else []) + (["--blend"] if args.blend else [])
    script = render_batch_script(request, merge_argv, header="megagate preprocess: merge the units")
    path = udir / "slurm" / "preprocess-merge.sbatch"
    if args.dry_run:
        write_script(script, path)
        lines.append(("out", f"merge: {path} (dry run: nothing submitted)"))
    else:
        job = submit(request, script, script_path=path)
        lines.append(("out", f"merge: {path} job {job}"))
    return lines


def _seconds(time_limit: str) -> int:
    from megagate.slurm import parse_time_limit

    return parse_time_limit(time_limit)
