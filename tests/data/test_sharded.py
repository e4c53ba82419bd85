"""Sharded preprocessing on real files: Parquet + JSONL.zst + JSONL, planned into units, processed in pieces, merged
into exactly the single run's bytes; resumable; every bad input one line, exit 2, nothing half-written."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers.mixed_corpus import paragraphs, write_mixed
from megagate.cli import main as cli_main
from megagate.data.indexed import read_document, validate
from megagate.data.tokenizer import EOD_TOKEN, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
UNIT_MB = "0.02"  # small units: the Parquet file is cut into row-group ranges


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return paragraphs(200_000)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, texts) -> list[Path]:
    return write_mixed(tmp_path_factory.mktemp("mixed"), texts)


@pytest.fixture(scope="module")
def single(tmp_path_factory, corpus, small_tok) -> str:
    """One plain `megagate preprocess` over the three files: the bytes every sharded run must reproduce."""
    out = tmp_path_factory.mktemp("single") / "one"
    assert _cli(corpus, out, small_tok) == 0
    return f"{out}_text_document"


def _cli(inputs, out, tok, *extra, workers="1") -> int:
    argv = ["preprocess", "-i", *map(str, inputs), "-o", str(out), "-t", tok, "-w", workers, "--no-progress"]
    return cli_main([*argv, "--unit-mb", UNIT_MB, *extra] if extra else argv)


def _same_files(a: str, b: str) -> None:
    for suffix in (".bin", ".idx", ".meta.json"):
        assert Path(a + suffix).read_bytes() == Path(b + suffix).read_bytes(), suffix


def _manifest(out: Path) -> dict:
    return json.loads(Path(f"{out}.units/manifest.json").read_text())


def test_single_run_reads_parquet_zst_and_jsonl_in_order(single, texts, small_tok):
    tok = load_tokenizer(small_tok)
    info = validate(single)
    assert info["documents"] == len(texts)
    for i in (0, len(texts) // 3, len(texts) // 2, len(texts) - 1):  # one document from each file
        assert tok.decode(read_document(single, i)) == texts[i] + EOD_TOKEN


def test_plan_cuts_parquet_into_row_group_units_and_prints_an_eta(corpus, small_tok, tmp_path, capsys):
    out = tmp_path / "o"
    assert _cli(corpus, out, small_tok, "--plan-only", "--tasks", "3") == 0
    printed = capsys.readouterr().out
    m = _manifest(out)
    parquet = [u for u in m["units"] if u["pieces"][0]["row_groups"] is not None]
    ranges = [tuple(u["pieces"][0]["row_groups"]) for u in parquet]
    import pyarrow.parquet as pq

    groups = pq.ParquetFile(corpus[0]).metadata.num_row_groups
    assert len(parquet) >= 2 and ranges[0][0] == 0 and ranges[-1][1] == groups  # the ranges tile the file
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert [u["task"] for u in m["units"]] == [k % 3 for k in range(len(m["units"]))]
    assert all(len(fp["sample_sha256"]) == 64 and fp["size"] > 0 for u in m["units"] for fp in u["inputs"])
    assert f"plan: {len(m['units'])} units, 3 tasks" in printed and "ETA 0:00:" in printed
    assert not list(tmp_path.glob("o_text_document*"))  # a plan writes no dataset


def test_units_in_any_order_then_merge_give_the_single_run_bytes(corpus, single, small_tok, tmp_path, capsys):
    out = tmp_path / "o"
    assert _cli(corpus, out, small_tok, "--plan-only", "--tasks", "2") == 0
    n = len(_manifest(out)["units"])
    assert _cli(corpus, out, small_tok, "--task-id", "1") == 0  # task 1 before task 0: order does not matter
    assert _cli(corpus, out, small_tok, "--merge") == 2
    assert "units not done" in capsys.readouterr().err and not Path(f"{out}_text_document.bin").exists()
    assert _cli(corpus, out, small_tok, "--task-id", "0", workers="2") == 0  # another worker count, same bytes
    assert _cli(corpus, out, small_tok, "--merge") == 0
    _same_files(f"{out}_text_document", single)
    summary = json.loads(Path(f"{out}.units/summary.json").read_text())
    assert len(summary["units"]) == n and summary["documents"] == validate(single)["documents"]
    assert sum(u["tokens"] for u in summary["units"]) == summary["tokens"]["text"] == validate(single)["tokens"]
    # megatron-core's own merge (IndexedDatasetBuilder.add_index, as Megatron-LM's merge_datasets.py) agrees
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(tmp_path / "mc.bin"), dtype=np.uint16)
    for k in range(n):
        builder.add_index(f"{out}.units/unit-{k:05d}_text_document")
    builder.finalize(str(tmp_path / "mc.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"mc{suffix}").read_bytes() == Path(f"{out}_text_document{suffix}").read_bytes()


def test_rerun_redoes_only_missing_and_changed_units(corpus, single, small_tok, tmp_path, capsys):
    inputs = [tmp_path / p.name for p in corpus]
    for src, dst in zip(corpus, inputs):
        dst.write_bytes(src.read_bytes())
    out = tmp_path / "o"
    assert _cli(inputs, out, small_tok, "--sharded") == 0
    m = _manifest(out)
    last = m["units"][-1]["id"]  # c.jsonl's unit
    Path(f"{out}.units/unit-00001.done.json").unlink()  # as if task 1 had been killed before its record
    # the JSONL input changes between plan and run: its unit is refused, then redone by the rerun
    inputs[2].write_text(inputs[2].read_text() + json.dumps({"text": "one more paragraph"}) + "\n")
    assert _cli(inputs, out, small_tok, "--unit", str(last)) == 2
    assert "changed since the plan (size, mtime_ns, sample_sha256)" in capsys.readouterr().err
    capsys.readouterr()
    assert _cli(inputs, out, small_tok, "--sharded", "--overwrite") == 0
    printed = capsys.readouterr().out
    redone = [
        int(line.split()[1][:-1]) for line in printed.splitlines() if line.startswith("unit ") and "already" not in line
    ]
    assert redone == [1, last]
    info = validate(f"{out}_text_document")
    assert info["documents"] == validate(single)["documents"] + 1
    one = np.fromfile(f"{single}.bin", dtype=np.uint16)
    assert np.array_equal(np.fromfile(f"{out}_text_document.bin", dtype=np.uint16)[: one.size], one)


def test_a_killed_unit_leaves_no_output_and_only_it_is_redone(corpus, single, small_tok, tmp_path):
    out = tmp_path / "o"
    hold = tmp_path / "held"
    env = dict(os.environ, MEGAGATE_PREPROCESS_HOLD=f"unit-00002:{hold}", PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "megagate", "preprocess", "-i", *map(str, corpus), "-o", str(out)]
    argv += ["-t", small_tok, "-w", "1", "--no-progress", "--unit-mb", UNIT_MB, "--sharded"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not hold.exists():  # units 0 and 1 are done, unit 2 has written its first chunk
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
        time.sleep(0.05)
    assert list(tmp_path.glob("o.units/unit-00002_text_document.bin.tmp-*"))  # killed mid-way, while writing
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not Path(f"{out}.units/unit-00002_text_document.bin").exists()
    assert not Path(f"{out}.units/unit-00002.done.json").exists() and not Path(f"{out}_text_document.bin").exists()
    env["MEGAGATE_PREPROCESS_HOLD"] = ""
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if "already done" in line] == ["unit 0", "unit 1"]
    assert any(line.startswith("unit 2: ") and "already" not in line for line in lines)
    _same_files(f"{out}_text_document", single)
    assert not list(tmp_path.glob("o.units/*.tmp-*"))  # the killed run's temporaries were cleared


def _parquet(path: Path, table) -> Path:
    import pyarrow.parquet as pq

    pq.write_table(table, path)
    return path


def _bad_inputs(tmp: Path) -> dict[str, tuple[Path, str]]:
    import pyarrow as pa
    import zstandard

    out = {
        "no column": (_parquet(tmp / "nocol.parquet", pa.table({"body": ["x"]})), "no column 'text' (columns: body)"),
        "not a string": (
            _parquet(tmp / "int.parquet", pa.table({"text": [1, 2]})),
            "column 'text' is int64, expected a string",
        ),
        "nested": (
            _parquet(tmp / "nested.parquet", pa.table({"text": [["a", "b"]]})),
            "column 'text' is nested (list<element: string>)",
        ),
    }
    good = _parquet(tmp / "good.parquet", pa.table({"text": ["a document"] * 50}))
    (tmp / "footer.parquet").write_bytes(good.read_bytes()[:-12])
    out["corrupt footer"] = (tmp / "footer.parquet", "footer.parquet: not a readable Parquet file")
    data = zstandard.ZstdCompressor().compress(b"".join(b'{"text": "line %d"}\n' % i for i in range(5000)))
    (tmp / "cut.jsonl.zst").write_bytes(data[: len(data) // 2])
    out["truncated zst"] = (
        tmp / "cut.jsonl.zst",
        f"truncated zstd stream: it ends inside a frame at compressed byte {len(data) // 2}",
    )
    return out


@pytest.mark.parametrize("case", ["no column", "not a string", "nested", "corrupt footer", "truncated zst"])
def test_bad_inputs_are_one_line_exit_2_nothing_written(case, small_tok, tmp_path, capsys):
    path, message = _bad_inputs(tmp_path)[case]
    assert _cli([path], tmp_path / "o", small_tok) == 2
    err = capsys.readouterr().err
    assert message in err and str(path.name) in err and len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.glob("o_*")) and not list(tmp_path.glob("*.tmp-*"))


def test_nulls_and_blank_rows_are_bad_records_with_their_row(small_tok, tmp_path, capsys):
    import pyarrow as pa

    path = _parquet(tmp_path / "n.parquet", pa.table({"text": ["first", None, "  ", "fourth"]}))
    assert _cli([path], tmp_path / "o", small_tok) == 0
    err = capsys.readouterr().err
    assert f"skipped {path} row 2: null in column 'text'" in err and f"{path} row 3: empty text" in err
    assert validate(f"{tmp_path}/o_text_document")["documents"] == 2


def test_sharded_refusals(corpus, small_tok, tmp_path, capsys):
    out = tmp_path / "o"
    assert _cli(corpus, out, small_tok, "--unit", "0") == 2
    assert "no manifest (run the same command with --plan-only first)" in capsys.readouterr().err
    assert _cli(corpus, out, small_tok, "--plan-only") == 0
    n = len(_manifest(out)["units"])
    capsys.readouterr()
    assert _cli(corpus, out, small_tok, "--unit", str(n)) == 2
    assert f"--unit {n}: the plan has units 0..{n - 1}" in capsys.readouterr().err
    assert _cli(corpus, out, small_tok, "--plan-only", "--no-append-eod") == 2  # a second manifest for one prefix
    assert "a manifest with other settings (append_eod) exists" in capsys.readouterr().err
    assert _cli(corpus, out, small_tok, "--unit", "0", "--merge") == 2
    assert "--unit and --merge: choose one of" in capsys.readouterr().err
    assert not list(tmp_path.glob("o_*")) and not list(tmp_path.glob("o.units/unit-*"))


def test_glob_patterns_expand_in_sorted_order(corpus, single, small_tok, tmp_path):
    pattern = str(corpus[0].parent / "*.*")  # a.parquet, b.jsonl.zst, c.jsonl
    assert cli_main(["preprocess", "-i", pattern, "-o", str(tmp_path / "g"), "-t", small_tok, "--no-progress"]) == 0
    _same_files(f"{tmp_path}/g_text_document", single)


def test_inspect_lists_units_and_checks_each_idx_against_its_bin(corpus, small_tok, tmp_path, capsys):
    out = tmp_path / "o"
    assert _cli(corpus, out, small_tok, "--sharded", "--tasks", "2") == 0
    summary = json.loads(Path(f"{out}.units/summary.json").read_text())
    capsys.readouterr()
    assert cli_main(["data", "inspect", f"{out}.units", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert [r["documents"] for r in stats["units"]] == [u["documents"] for u in summary["units"]]
    assert sum(r["tokens"] for r in stats["units"]) == summary["tokens"]["text"] and stats["missing"] == []
    Path(f"{out}.units/unit-00001.done.json").unlink()
    assert cli_main(["data", "inspect", f"{out}.units/manifest.json"]) == 0
    assert "1 not done" in capsys.readouterr().out
    with open(f"{out}.units/unit-00000_text_document.bin", "r+b") as f:
        f.truncate(10)
    assert cli_main(["data", "inspect", f"{out}.units"]) == 2
    err = capsys.readouterr().err
    assert "unit-00000_text_document.bin: size 10 bytes does not match its index" in err


def test_blend_instead_of_a_merge_weights_units_by_tokens(corpus, single, small_tok, tmp_path):
    import yaml

    from megagate.data.loader import parse_blend

    out = tmp_path / "o"
    assert _cli(corpus, out, small_tok, "--sharded", "--blend") == 0
    assert not Path(f"{out}_text_document.bin").exists()  # no merged copy
    doc = yaml.safe_load(Path(f"{out}_text_blend.yaml").read_text())
    prefixes, weights = parse_blend(doc["data"]["blend"])  # what data.blend is read with
    assert [validate(p)["tokens"] for p in prefixes] == weights
    assert sum(weights) == validate(single)["tokens"] and doc["data"]["tokenizer"] == str(Path(small_tok).resolve())
    merged = np.concatenate([np.fromfile(f"{p}.bin", dtype=np.uint16) for p in prefixes])
    assert np.array_equal(merged, np.fromfile(f"{single}.bin", dtype=np.uint16))


def test_slurm_dry_run_renders_the_array_of_missing_tasks_and_the_merge(corpus, small_tok, tmp_path, capsys):
    out = tmp_path / "o"
    assert _cli(corpus, out, small_tok, "--tasks", "3", "--unit", "0", "--plan-only") == 2  # one mode at a time
    assert _cli(corpus, out, small_tok, "--tasks", "3", "--plan-only") == 0
    assert _cli(corpus, out, small_tok, "--tasks", "3", "--task-id", "0") == 0  # task 0 done: not resubmitted
    capsys.readouterr()
    assert _cli(corpus, out, small_tok, "--tasks", "3", "--slurm", "--dry-run", "--slurm-max-parallel", "2") == 0
    array = Path(f"{out}.units/slurm/preprocess-array.sbatch").read_text()
    merge = Path(f"{out}.units/slurm/preprocess-merge.sbatch").read_text()
    assert "#SBATCH --array=1,2%2" in array and "#SBATCH --cpus-per-task=1" in array
    assert "megagate preprocess --input" in array and "--task-id env" in array and "--unit-mb 0.02" in array
    assert "--merge" in merge and "--task-id" not in merge and "MEGAGATE_MAX_RESTARTS=0" in merge
    assert "dry run: nothing submitted" in capsys.readouterr().out


def test_a_finished_sharded_run_is_not_redone_without_overwrite(corpus, small_tok, tmp_path, capsys):
    out = tmp_path / "o"
    assert _cli(corpus, out, small_tok, "--sharded") == 0
    capsys.readouterr()
    for mode in (["--sharded"], ["--slurm", "--dry-run"], ["--merge"]):
        assert _cli(corpus, out, small_tok, *mode) == 2
        assert "o_text_document.bin' already exists; pass --overwrite" in capsys.readouterr().err
    assert not Path(f"{out}.units/slurm").exists()  # nothing rendered, nothing queued
