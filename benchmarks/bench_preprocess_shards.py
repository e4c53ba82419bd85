"""Sharded preprocessing against one process, and the merge against a plain copy, in one run.

    .venv/bin/python benchmarks/bench_preprocess_shards.py [--mb 100] [--workers 2] [--vocab 8192] [--no-slurm]

A Parquet corpus of about `--mb` MB (the stdlib real-text corpus of megagate.data.corpus, repeated to size, cut
into 8 files of 1,000-row row groups), a BPE trained on its first 2 MB. Then:
  * one `megagate preprocess` with W workers (wall time, tokens/s);
  * the same inputs as a 2-task Slurm array of W/2 workers each on the local cluster (slurm/local/cluster.py,
    started and stopped here; needs root and the Slurm binaries) plus its merge job: wall time from submission to
    the merge's end, and whether the merged bytes equal the single run's;
  * the merge alone (`shards.merge` over the units, run again) against a plain copy of the same unit `.bin` bytes
    into one file (`shutil.copyfileobj`), in GB/s, best of 3 each.
Printed: the figures and their ratios. No assertions: figures only.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def build_corpus(folder: Path, mb: float, files: int = 8) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megagate.data.corpus import build_documents

    texts = [d["text"] for d in build_documents(None)]
    per_copy = sum(len(t.encode()) for t in texts)
    if mb * 1e6 < per_copy:  # a small corpus: the first documents (no repeats)
        texts = [d["text"] for d in build_documents(int(mb * 1e6))]
    texts = texts * max(1, round(mb * 1e6 / per_copy))
    folder.mkdir(parents=True, exist_ok=True)
    files = min(files, len(texts))  # a tiny corpus: no empty file
    step = -(-len(texts) // files)
    paths = []
    for i in range(files):
        part = texts[i * step : (i + 1) * step]
        if part:
            p = folder / f"shard-{i:03d}.parquet"
            pq.write_table(pa.table({"text": part}), p, row_group_size=1000)
            paths.append(p)
    return paths


def run_cli(argv: list[str], env: dict | None = None) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "megagate", *argv], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"megagate {' '.join(argv[:3])} failed: {proc.stderr.strip()[-2000:]}")
    return time.perf_counter() - t0, proc.stdout


def slurm_array(inputs, out: Path, tok: str, workers: int, state: Path) -> float | None:
    spec = importlib.util.spec_from_file_location("cluster", REPO / "slurm" / "local" / "cluster.py")
    cluster_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cluster_mod)
    if not cluster_mod.slurm_installed() or os.geteuid() != 0:
        print("slurm: skipped (needs root and the Slurm binaries: bash slurm/local/install.sh)")
        return None
    cluster = cluster_mod.LocalCluster(state)
    cluster.start()
    try:
        env = cluster.env | {"PYTHONPATH": str(REPO)}
        argv = ["preprocess", "-i", *map(str, inputs), "-o", str(out), "-t", tok, "-w", str(max(1, workers // 2))]
        argv += ["--tasks", "2", "--unit-mb", str(sum(p.stat().st_size for p in inputs) / 2e6 + 0.01)]
        argv += ["--slurm", "--slurm-time", "30:00", "--no-progress"]
        t0 = time.perf_counter()
        _, printed = run_cli(argv, env)
        merge = re.search(r"^merge: .* job (\d+)$", printed, flags=re.M).group(1)
        while True:
            show = cluster.run("scontrol", "show", "job", "-o", merge, check=False).stdout
            state_m = re.search(r"JobState=(\S+)", show)
            if state_m and state_m.group(1) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
                break
            time.sleep(0.2)
        wall = time.perf_counter() - t0
        if state_m.group(1) != "COMPLETED":
            raise SystemExit(f"merge job {merge}: {state_m.group(1)} (logs in {out}.units/logs)")
        return wall
    finally:
        cluster.stop()


def merge_vs_copy(out: Path, rounds: int = 3) -> tuple[float, float, int]:
    from megagate.data import shards
    from megagate.data import units as U

    udir = U.units_dir(str(out))
    bins = sorted(udir.glob("unit-*_text_document.bin"))
    size = sum(p.stat().st_size for p in bins)
    best_merge = best_copy = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        shards.merge(str(out), overwrite=True)
        best_merge = min(best_merge, time.perf_counter() - t0)
        t0 = time.perf_counter()
        with open(out.parent / "plain-copy.bin", "wb") as dst:
            for p in bins:
                with open(p, "rb") as src:
                    shutil.copyfileobj(src, dst, 16 << 20)
            dst.flush()
            os.fsync(dst.fileno())
        best_copy = min(best_copy, time.perf_counter() - t0)
    return size / best_merge / 1e9, size / best_copy / 1e9, size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=100.0, help="corpus size in MB (default 100)")
    ap.add_argument("--workers", type=int, default=2, help="W: the single run's workers; each task has W/2")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--no-slurm", action="store_true", help="skip the array (the merge is then of a --sharded run)")
    args = ap.parse_args()
    from megagate.data.corpus import iter_documents
    from megagate.data.tokenizer import train_bpe

    with tempfile.TemporaryDirectory(prefix="bench-shards-") as tmp:
        root = Path(tmp)
        inputs = build_corpus(root / "in", args.mb)
        disk = sum(p.stat().st_size for p in inputs)
        tok = str(train_bpe((d["text"] for d in iter_documents(2_000_000)), root / "tok.json", args.vocab))
        print(f"corpus: {len(inputs)} Parquet files, {disk / 1e6:.1f} MB on disk; BPE {args.vocab}")
        one = root / "one"
        t_one, printed = run_cli(
            ["preprocess", "-i", *map(str, inputs), "-o", str(one), "-t", tok, "-w", str(args.workers), "--no-progress"]
        )
        tokens = int(re.search(r"([\d,]+) tokens in", printed).group(1).replace(",", ""))
        print(f"one process, {args.workers} workers: {t_one:.1f} s ({tokens / t_one:,.0f} tokens/s, with start-up)")
        out = root / "arr" / "corpus"
        t_arr = None if args.no_slurm else slurm_array(inputs, out, tok, args.workers, root / "slurm")
        if t_arr is None:
            half = str(sum(p.stat().st_size for p in inputs) / 2e6 + 0.01)
            run_cli(
                [
                    "preprocess",
                    "-i",
                    *map(str, inputs),
                    "-o",
                    str(out),
                    "-t",
                    tok,
                    "-w",
                    str(args.workers),
                    "--sharded",
                    "--unit-mb",
                    half,
                    "--no-progress",
                ]
            )
        else:
            print(
                f"2-task array x {max(1, args.workers // 2)} workers + merge job: {t_arr:.1f} s "
                f"({tokens / t_arr:,.0f} tokens/s; {t_one / t_arr:.2f}x the one process, submission to merge end)"
            )
        same = all(
            Path(f"{one}_text_document{s}").read_bytes() == Path(f"{out}_text_document{s}").read_bytes()
            for s in (".bin", ".idx", ".meta.json")
        )
        print(f"merged bytes equal the one process's: {same}")
        g_merge, g_copy, size = merge_vs_copy(out)
        print(
            f"merge: {g_merge:.2f} GB/s, plain copy: {g_copy:.2f} GB/s of {size / 1e6:.1f} MB ({g_merge / g_copy:.2f}x the copy)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
