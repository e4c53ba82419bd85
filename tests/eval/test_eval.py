"""`megagate eval` end to end on a real tiny run: it reproduces the trainer's own validation loss, a YaRN override
changes the model it evaluates, TP=2 / PP=2 / DP=2 (torchrun, gloo) give the single-process numbers, and the bad
inputs that need a real checkpoint are one line with exit 2."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import forked
from helpers import tiny_runs as T

YARN = ["--rope", "position_embedding=yarn", "yarn_factor=4", "yarn_original_max_position_embeddings=64"]


@pytest.fixture(scope="module")
def run_dir(reference_run) -> Path:
    """A 12-step tiny run (seq 64, 8 samples x 1 validation batch, G1 gate), validated at its end (conftest's)."""
    return reference_run


def megagate_eval(out: Path, *args: str, nproc: int = 1) -> dict:
    """Run `megagate eval` (a forked child of helpers.forked; the real torchrun for nproc > 1) and return its
    results.json."""
    argv = ["eval", *args, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        proc = forked.run_cli(argv, env=env, timeout=600)
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        proc = subprocess.run([*launcher, "-m", "megagate", *argv], cwd=T.ROOT, env=env, capture_output=True,
                              text=True, timeout=600)  # fmt: skip
    cmd = proc.args
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "checkpoint" in proc.stdout and "ppl" in proc.stdout  # the table
    assert (out / "ppl_vs_length.png").stat().st_size > 1000
    return json.loads((out / "results.json").read_text())


def rows(results: dict) -> dict:
    return {(r["data"], r["seq_length"]): r for r in results["checkpoints"][0]["results"]}


@pytest.fixture(scope="module")
def plain(run_dir, tmp_path_factory) -> dict:
    """The run's own validation split at its length (64) and twice it, as trained (RoPE, base 10k)."""
    return megagate_eval(
        tmp_path_factory.mktemp("eval-plain"), str(run_dir), "--data", "@run", "--seq-lengths", "64,128",
        "--samples", "8", "--micro-batch-size", "2", "--buckets", "4",
    )  # fmt: skip


@pytest.fixture(scope="module")
def yarn_single(run_dir, tmp_path_factory) -> dict:
    return megagate_eval(
        tmp_path_factory.mktemp("eval-yarn-1"), str(run_dir), "--data", "@run", "--seq-lengths", "64,256",
        "--samples", "8", "--micro-batch-size", "2", *YARN,
    )  # fmt: skip


def test_eval_at_training_length_reproduces_trainer_validation(run_dir, plain):
    """The run's validation split at its length, the trainer's 8 samples: the trainer's loss to float rounding
    (the trainer averages 4 micro-batch means in fp32, eval sums 512 token losses in fp64; the mask is all ones)."""
    results = plain
    summary = json.loads((run_dir / "summary.json").read_text())
    valid = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"valid"' in x]
    r = rows(results)[("@run", 64)]
    assert r["samples"] == 8 and r["tokens"] == 8 * 64
    assert r["loss"] == pytest.approx(summary["final_valid_loss"], rel=1e-6, abs=0)
    assert r["loss"] == pytest.approx(valid[-1]["loss"], rel=1e-6, abs=0) and valid[-1]["step"] == 12
    assert r["ppl"] == pytest.approx(math.exp(r["loss"]))
    # four buckets of 16 positions whose token-weighted mean is the window's loss
    assert [(b["start"], b["end"]) for b in r["buckets"]] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert sum(b["loss"] for b in r["buckets"]) / 4 == pytest.approx(r["loss"], rel=1e-9)
    # the diagnostics of every layer at each length: first-token attention is a probability, M-Act positive
    for length in (64, 128):
        d = rows(results)[("@run", length)]["diagnostics"]
        assert [x["layer"] for x in d["layers"]] == [0, 1]
        assert 0 < d["f_attn"] < 1 and d["m_act"] > 0 and d["gate_score_mean"] is not None
    ckpt = results["checkpoints"][0]
    assert ckpt["step"] == 12 and ckpt["position_embedding"]["position_embedding"] == "rope"
    # the short length sees fewer distinct positions: uniform-ish attention puts more mass on token 0
    assert rows(results)[("@run", 64)]["diagnostics"]["f_attn"] > rows(results)[("@run", 128)]["diagnostics"]["f_attn"]


@pytest.mark.slow
def test_yarn_override_changes_the_evaluated_model(plain, yarn_single):
    """--rope position_embedding=yarn (factor 4 from 64) reaches 256 tokens, and at 64 it is another model than the
    trained RoPE one (interpolated slow dims, q and k scaled by 0.1 ln 4 + 1): the loss moves."""
    pos = yarn_single["checkpoints"][0]["position_embedding"]
    assert pos["position_embedding"] == "yarn" and pos["context_length"] == 256
    a, b = rows(plain)[("@run", 64)]["loss"], rows(yarn_single)[("@run", 64)]["loss"]
    assert abs(a - b) > 1e-4, (a, b)
    assert rows(yarn_single)[("@run", 256)]["tokens"] == 8 * 256


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2"]], ids=["tp2", "pp2"])
def test_parallel_layouts_match_one_process(run_dir, yarn_single, tmp_path, layout):
    """2 processes over gloo (torchrun): TP=2 shards heads and vocabulary, PP=2 splits the layers (megatron's
    forward-only 1F1B schedule); losses, position buckets and diagnostics equal the one-process evaluation."""
    results = megagate_eval(
        tmp_path, str(run_dir), "--data", "@run", "--seq-lengths", "64,256", "--samples", "8",
        "--micro-batch-size", "2", *YARN, *layout, nproc=2,
    )  # fmt: skip
    assert results["layout"]["dp"] == 1 and results["layout"]["world"] == 2
    ours, ref = rows(results), rows(yarn_single)
    for key in ref:
        assert ours[key]["loss"] == pytest.approx(ref[key]["loss"], rel=1e-5), key
        assert ours[key]["tokens"] == ref[key]["tokens"]
        for b1, b2 in zip(ours[key]["buckets"], ref[key]["buckets"]):
            assert b1["loss"] == pytest.approx(b2["loss"], rel=1e-5), key
        d1, d2 = ours[key]["diagnostics"], ref[key]["diagnostics"]
        for name in ("f_attn", "m_act", "max_logit", "gate_score_mean"):
            assert d1[name] == pytest.approx(d2[name], rel=1e-5), (key, name)


@pytest.mark.parametrize(
    "extra, value",
    [
        (["--seq-lengths", "256"], "length 256 exceeds the 128 tokens"),  # beyond max_sequence_length, no RoPE change
        (["--seq-lengths", "1024", *YARN], "length 1024 exceeds the 256 tokens"),  # beyond YaRN's reach
        (["--seq-lengths", "64", "--rope", "yarn_factor=4"], "yarn_factor is a YaRN setting"),  # a RoPE checkpoint
        # Llama-3 scaling x4 from its default 8192 slows none of the dims that turn less than once in 128 tokens
        (["--seq-lengths", "512", "--rope", "rope_scaling=true", "rope_scaling_factor=4"], "exceeds the 128 tokens"),
        (["--seq-lengths", "64", "--tp", "3"], "--tp 3 x --pp 1 does not divide the 1 processes"),
        # the run's validation split holds fewer tokens than one window (found while building its index, before
        # any model is loaded)
        (["--seq-lengths", "100000", "--rope", "max_sequence_length=100000"], "no sample of 100000 tokens"),
    ],
    ids=["too-long", "beyond-yarn", "yarn-key-on-rope", "llama3-from-8192", "layout", "too-few-tokens"],
)
def test_bad_inputs_with_a_checkpoint_are_one_line(run_dir, tmp_path, capsys, monkeypatch, extra, value):
    from megagate.cli import main

    monkeypatch.chdir(tmp_path)
    rc = main(["eval", str(run_dir), "--data", "@run", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("megagate eval: error: ") and value in err, err
    if "divide" in value or "no sample" in value:
        return  # a layout / dataset refusal names the layout / dataset; the latter leaves the index cache
    assert str(run_dir / "checkpoints" / "iter_0000012") in err  # names the checkpoint
    assert not list(tmp_path.iterdir())  # nothing written


def test_resume_accepts_changed_position_embedding(run_dir):
    """A context extension changes the position fields on resume: the trainer's own compatibility check lets them
    through, and still refuses a change of a weight-defining field."""
    import copy

    from megagate import checkpoint as ckpt
    from megagate import config_reader
    from megagate.errors import MegagateError
    from megagate.train.resume import check_compatible

    meta = ckpt.read_meta(run_dir / "checkpoints" / "iter_0000012")
    raw = copy.deepcopy(meta["config"])
    raw["model"].update(position_embedding="yarn", yarn_factor=4.0, rotary_base=1_000_000, max_sequence_length=512)
    check_compatible(meta, config_reader.from_dict(raw, environment=False))
    raw["model"]["num_layers"] = 4
    with pytest.raises(MegagateError, match="num_layers 2 -> 4"):
        check_compatible(meta, config_reader.from_dict(raw, environment=False))
