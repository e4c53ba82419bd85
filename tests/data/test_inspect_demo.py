import json

from megagate.cli import main as cli_main
from megagate.data.demo import prepare_demo_data
from megagate.data.indexed import validate
from megagate.data.tokenizer import EOD_TOKEN, load_tokenizer


def test_inspect_prints_counts_histogram_and_decoded_sample(tmp_path, capsys):
    tok_path, prefix = prepare_demo_data(tmp_path, vocab_size=1024, max_bytes=150_000)
    info = validate(prefix)
    assert cli_main(["data", "inspect", prefix, "--document", "1"]) == 0
    out = capsys.readouterr().out
    assert f"documents {info['documents']:,}   tokens {info['tokens']:,}" in out
    assert f"{info['documents']:,} of {info['documents']:,} documents end with the end-of-document token" in out
    tok = load_tokenizer(tok_path)
    from megagate.data.indexed import read_document

    assert tok.decode(read_document(prefix, 1))[:200] in out
    assert cli_main(["data", "inspect", prefix, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert sum(c for _, _, c in stats["histogram"]) == info["documents"]
    assert stats["length_max"] == int(info["lengths"].max())
    # the demo data is cached: a second call rebuilds nothing
    mtimes = {p.name: p.stat().st_mtime_ns for p in (tmp_path).rglob("*") if p.is_file()}
    assert prepare_demo_data(tmp_path, vocab_size=1024, max_bytes=150_000) == (tok_path, prefix)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path).rglob("*") if p.is_file()} == mtimes
    assert tok.decode(read_document(prefix, 0)).endswith(EOD_TOKEN)


def test_inspect_damaged_dataset(tmp_path, capsys):
    _, prefix = prepare_demo_data(tmp_path, vocab_size=512, max_bytes=40_000)
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(100)
    assert cli_main(["data", "inspect", prefix]) == 2
    err = capsys.readouterr().err
    assert "corpus_text_document.idx: corrupt or truncated index" in err and "Traceback" not in err


def test_tokenizer_train_and_verify_cli(tmp_path, capsys, small_docs):
    from megagate.data.corpus import write_jsonl

    inp = write_jsonl(small_docs[:80], tmp_path / "c.jsonl")
    assert cli_main(["tokenizer", "train", "-i", str(inp), "-o", str(tmp_path / "tok"), "--vocab-size", "700"]) == 0
    out = capsys.readouterr().out
    assert "tokenizer.json: 700 tokens, end-of-document id 0, padding id 1, engine fast" in out
    assert (
        cli_main(
            ["tokenizer", "verify", str(tmp_path / "tok" / "tokenizer.json"), "-i", str(inp), "--probe-step", "11"]
        )
        == 0
    )
    assert "fast engine matches HF" in capsys.readouterr().out
    assert cli_main(["tokenizer", "train", "-i", str(inp), "-o", str(tmp_path / "t2"), "--vocab-size", "100"]) == 2
    assert "vocab_size=100: must be at least 259" in capsys.readouterr().err
