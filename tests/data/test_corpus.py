import json

from megagate.data.corpus import build_demo_corpus, build_documents, module_docstrings


def test_corpus_is_deterministic_sized_and_mixed(small_docs):
    again = build_documents(300_000)
    assert [d["text"] for d in again] == [d["text"] for d in small_docs]
    sizes = [len(d["text"].encode()) for d in small_docs]
    assert sum(sizes) >= 300_000 and sum(sizes) - sizes[-1] < 300_000  # stops at the first doc past the budget
    by_source = {}
    for d, n in zip(small_docs, sizes):
        by_source[d["source"]] = by_source.get(d["source"], 0) + n
    assert by_source.get("code", 0) > 0.3 * sum(sizes)
    assert by_source.get("docstring", 0) + by_source.get("license", 0) > 0.3 * sum(sizes)
    assert len({d["id"] for d in small_docs}) == len(small_docs)


def test_docstrings_are_prose_not_code():
    src = 'def f():\n    """Return the answer to the question that was asked before."""\n    return 42\n'
    assert module_docstrings(src) == "Return the answer to the question that was asked before."


def test_demo_corpus_jsonl(tmp_path):
    path = build_demo_corpus(tmp_path, 50_000)
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    assert [r["text"] for r in rows] == [d["text"] for d in build_documents(50_000)]
    mtime = path.stat().st_mtime_ns
    assert build_demo_corpus(tmp_path, 50_000) == path and path.stat().st_mtime_ns == mtime  # reused
