import gzip
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megagate.cli import main as cli_main
from megagate.data.corpus import write_jsonl
from megagate.data.indexed import validate
from megagate.data.preprocess import TokenizerSpec, preprocess
from megagate.data.tokenizer import EOD_TOKEN, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def _read_back(prefix: str, tok_path: str) -> list[str]:
    """Decode every document through megatron's IndexedDataset."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tok = load_tokenizer(tok_path, engine="hf")
    ds = IndexedDataset(prefix)
    return [tok.decode(ds[i]) for i in range(len(ds))]


def _make_inputs(kind: str, docs: list[dict], d: Path) -> tuple[list[str], dict[str, list[str]], dict]:
    """(inputs, expected texts per key, preprocess kwargs)."""
    texts = [x["text"] for x in docs]
    if kind == "jsonl":
        return [str(write_jsonl(docs, d / "c.jsonl"))], {"text": texts}, {}
    if kind == "jsonl.gz":
        with gzip.open(d / "c.jsonl.gz", "wt", encoding="utf-8") as f:
            for x in docs:
                f.write(json.dumps({"text": x["text"]}) + "\n")
        return [str(d / "c.jsonl.gz")], {"text": texts}, {}
    if kind == "text-folder":
        folder = d / "txt"
        for i, t in enumerate(texts):
            sub = folder / f"part{i % 3}"
            sub.mkdir(parents=True, exist_ok=True)
            (sub / f"doc{i:04d}.txt").write_text(t, encoding="utf-8")
        order = sorted(range(len(texts)), key=lambda i: f"part{i % 3}/doc{i:04d}.txt")
        return [str(folder)], {"text": [texts[i] for i in order]}, {}
    if kind == "multi-key":
        rows = [{"title": x["id"], "text": x["text"], "n": 1} for x in docs]
        write_jsonl(rows, d / "m.jsonl")
        return [str(d / "m.jsonl")], {"title": [x["id"] for x in docs], "text": texts}, {"keys": ("title", "text")}
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "text-folder", "multi-key"])
def test_round_trip_through_indexed_and_gpt_dataset(kind, small_docs, full_docs, small_tok, tmp_path):
    docs = small_docs + full_docs[::25]  # licenses, docstrings and code of all sizes
    assert len(docs) > 60
    inputs, expected, kw = _make_inputs(kind, docs, tmp_path)
    res = preprocess(inputs, str(tmp_path / "out"), small_tok, workers=2, progress=False, chunk_bytes=64 << 10, **kw)
    assert set(res.prefixes) == set(expected)
    for key, prefix in res.prefixes.items():
        assert prefix == str(tmp_path / f"out_{key}_document")
        assert _read_back(prefix, small_tok) == [t + EOD_TOKEN for t in expected[key]]  # every key finalized
    _check_gpt_dataset(res.prefixes["text"], small_tok, expected["text"], seq=256)


def _check_gpt_dataset(prefix: str, tok_path: str, texts: list[str], seq: int = 64) -> None:
    """Every GPTDataset sample is the right window of the shuffled document stream, and decodes to it."""
    from megagate.data.loader import build_datasets

    tok = load_tokenizer(tok_path, engine="hf")
    train, _, _ = build_datasets(
        [prefix], tokenizer=tok, seq_length=seq, split="1,0,0", num_samples=(None, None, None), seed=3
    )
    docs = [tok.encode(t) for t in texts]
    stream = np.concatenate([np.append(docs[d], tok.eod) for d in train.document_index])
    assert len(train) == (stream.size - 1) // seq
    for idx in range(len(train)):
        s = train[idx]
        j = int(train.shuffle_index[idx])
        window = stream[j * seq : j * seq + seq + 1]
        assert np.array_equal(s["tokens"].numpy(), window[:-1]) and np.array_equal(s["labels"].numpy(), window[1:])
        assert np.array_equal(s["position_ids"].numpy(), np.arange(seq)) and float(s["loss_mask"].sum()) == seq
    # and the stream, cut at end-of-document tokens, decodes back to the documents in the shuffled order
    cut = np.split(stream, np.flatnonzero(stream == tok.eod)[:-1] + 1)
    assert [tok.decode(c) for c in cut] == [texts[d] + EOD_TOKEN for d in train.document_index]


def test_worker_count_and_engine_do_not_change_output_bytes(small_docs, small_tok, tmp_path):
    inp = write_jsonl(small_docs, tmp_path / "c.jsonl")
    outs = []
    for engine, workers in (("fast", 1), ("fast", 2), ("hf", 2), ("fast", 0)):
        res = preprocess(
            [inp],
            str(tmp_path / f"o{engine}{workers}"),
            TokenizerSpec(small_tok, engine),
            workers=workers,
            progress=False,
            chunk_bytes=32 << 10,
        )
        assert res.engine == engine
        p = res.prefixes["text"]
        outs.append((open(p + ".bin", "rb").read(), open(p + ".idx", "rb").read()))
    assert all(o == outs[0] for o in outs)
    assert validate(res.prefixes["text"])["documents"] == len(small_docs)


def _bad_input(path: Path) -> None:
    good = json.dumps({"text": "a good line"}).encode()
    lines = [
        good,
        b'{"text": "unterminated',
        json.dumps({"body": "x"}).encode(),
        b'{"text": "caf\xe9"}',
        json.dumps({"text": "   "}).encode(),
        b"",
        json.dumps(["a", "list"]).encode(),
        json.dumps({"text": 7}).encode(),
        good,
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_bad_lines_are_counted_reported_and_skipped(small_tok, tmp_path):
    _bad_input(tmp_path / "bad.jsonl")
    logs = []
    res = preprocess(
        [tmp_path / "bad.jsonl"], str(tmp_path / "o"), small_tok, workers=0, progress=False, log=logs.append
    )
    assert res.documents == 2 and res.bad_lines == 6 and res.blank_lines == 1
    assert res.bad_by_reason == {
        "invalid JSON": 1,
        "missing key 'text'": 1,
        "not UTF-8": 1,
        "empty text in key 'text'": 1,
        "not a JSON object": 1,
        "key 'text' is int, expected a string": 1,
    }
    bad = str(tmp_path / "bad.jsonl")
    assert [line.split(": ")[0] for line in logs] == [f"skipped {bad}:{n}" for n in (2, 3, 4, 5, 7, 8)]
    assert _read_back(res.prefixes["text"], small_tok) == ["a good line" + EOD_TOKEN] * 2


def test_bad_line_fatal_via_cli_writes_nothing(small_tok, tmp_path, capsys):
    _bad_input(tmp_path / "bad.jsonl")
    rc = cli_main(
        [
            "preprocess",
            "-i",
            str(tmp_path / "bad.jsonl"),
            "-o",
            str(tmp_path / "o"),
            "-t",
            small_tok,
            "--bad-lines",
            "error",
            "-w",
            "1",
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "bad.jsonl:2: invalid JSON" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--engine", "turbo"], "tokenizer engine 'turbo': allowed values are auto, hf, fast"),
        (["--bad-lines", "ignore"], "bad-line policy 'ignore': allowed values are skip, error"),
        (["--workers", "-3"], "workers=-3: must be between 0 and 1024"),
        (["--text-mode", "para"], "text mode 'para': allowed values are file, line"),
    ],
)
def test_cli_user_errors(small_tok, tmp_path, capsys, args, message):
    write_jsonl([{"text": "x"}], tmp_path / "c.jsonl")
    rc = cli_main(
        [
            "preprocess",
            "-i",
            str(tmp_path / "c.jsonl"),
            "-o",
            str(tmp_path / "o"),
            "-t",
            small_tok,
            "--no-progress",
            *args,
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err
    assert not list(tmp_path.glob("o_*"))


def test_cli_refuses_to_overwrite_and_rejects_unknown_inputs(small_tok, tmp_path, capsys):
    write_jsonl([{"text": "x"}], tmp_path / "c.jsonl")
    base = [
        "preprocess",
        "-i",
        str(tmp_path / "c.jsonl"),
        "-o",
        str(tmp_path / "o"),
        "-t",
        small_tok,
        "--no-progress",
        "-w",
        "0",
    ]
    assert cli_main(base) == 0
    assert cli_main(base) == 2 and "already exists; pass --overwrite" in capsys.readouterr().err
    assert cli_main(base + ["--overwrite"]) == 0
    (tmp_path / "data.csv").write_text("a,b")
    assert cli_main(["preprocess", "-i", str(tmp_path / "data.csv"), "-o", str(tmp_path / "q"), "-t", small_tok]) == 2
    assert "data.csv': unsupported file type (allowed: .jsonl" in capsys.readouterr().err


def _start(inp, out, tok) -> subprocess.Popen:
    cmd = [
        PY,
        "-m",
        "megagate",
        "preprocess",
        "-i",
        str(inp),
        "-o",
        str(out),
        "-t",
        tok,
        "-w",
        "1",
        "--chunk-mb",
        "0.25",
        "--no-progress",
    ]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_temp(folder: Path, proc: subprocess.Popen) -> None:
    deadline = time.time() + 60
    while time.time() < deadline:
        tmp = [p for p in folder.glob("out_text_document.bin.tmp-*") if p.stat().st_size > 0]
        if tmp:
            return
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.05)
    raise AssertionError("preprocessing never started writing")


@pytest.mark.slow  # ~15 s of CPU: real preprocess processes killed mid-write
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_interrupted_run_leaves_no_finished_files_and_rerun_completes(full_docs, big_tok, tmp_path, sig):
    inp = write_jsonl(full_docs, tmp_path / "c.jsonl")  # ~10 MB: several seconds with one worker
    proc = _start(inp, tmp_path / "out", big_tok)
    _wait_for_temp(tmp_path, proc)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "out_text_document.bin" not in names and "out_text_document.idx" not in names
    if sig == signal.SIGTERM:  # a graceful stop also removes its temporaries and says so
        assert proc.returncode == 2 and names == ["c.jsonl"]
        assert "interrupted; temporary files removed" in proc.stderr.read().decode()
    proc = _start(inp, tmp_path / "out", big_tok)
    assert proc.wait(timeout=300) == 0, proc.stderr.read().decode()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "c.jsonl",
        "out_text_document.bin",
        "out_text_document.idx",
        "out_text_document.meta.json",
    ]
    info = validate(str(tmp_path / "out_text_document"))
    assert info["documents"] == len(full_docs)
    tok = load_tokenizer(big_tok)
    sample = [0, len(full_docs) // 2, len(full_docs) - 1]
    from megagate.data.indexed import read_document

    assert [tok.decode(read_document(str(tmp_path / "out_text_document"), i)) for i in sample] == [
        full_docs[i]["text"] + EOD_TOKEN for i in sample
    ]


def test_progress_line_reports_rates_and_eta(small_docs, small_tok, tmp_path, capsys):
    inp = write_jsonl(small_docs, tmp_path / "c.jsonl")
    res = preprocess([inp], str(tmp_path / "o"), small_tok, workers=0, progress=True)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"[100.0%] {len(small_docs)} docs ")
    for field in ("docs/s", "tok/s", "MB/s", "ETA 0:00:00", "elapsed"):
        assert field in last
    assert res.documents == len(small_docs) and res.total_tokens == validate(res.prefixes["text"])["tokens"]
