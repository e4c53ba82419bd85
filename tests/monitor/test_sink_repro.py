"""The CPU sink reproduction of docs/science.md ("A sink on purpose"): the synthetic BOS corpus
(megagate.data.synthetic, `megagate data synth`), every training sample starting at BOS through the trainer's own
dataset builder, the untrained model below the sink threshold, and (slow) the shipped examples/sink_repro_cpu.yaml
trained as the baseline, whose sink the probe finds. No ordering of G1 and the softmax sinks is asserted: over 3
seeds they form sinks too and the seed spread is as large as the differences (docs/science.md §6).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import forked
from megagate import config_reader
from megagate.cli import main
from megagate.data import synthetic
from megagate.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "sink_repro_cpu.yaml"
# the data command of the config's header
SYNTH = ["--documents", "4096", "--length", "64", "--vocab", "64", "--zipf", "1.0", "--triggers", "2"]
# Sink^0.3_1 and F-Attn: the lowest of 6 trained baseline runs (3 seeds x 600 / 1000 steps) measured 0.25 and 0.133,
# seed 0 at 600 steps (this test's run) 0.656 and 0.349; the untrained model 0 and ~0.06 (uniform: 0.059)
THRESHOLD = 0.2
F_ATTN_THRESHOLD = 0.1


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sink-data")
    assert main(["data", "synth", "--out", str(out), *SYNTH]) == 0
    return out


def data_overrides(corpus: Path) -> list[str]:
    return [f"data.blend=[{corpus / synthetic.PREFIX_NAME}]", f"data.tokenizer={corpus / 'tokenizer.json'}"]


def test_documents_are_bos_then_the_body(corpus):
    tokens = np.fromfile(corpus / f"{synthetic.PREFIX_NAME}.bin", dtype=np.uint16).reshape(4096, 64)
    assert (tokens[:, 0] == synthetic.BOS_ID).all() and (tokens[:, 1:] != synthetic.BOS_ID).all()
    triggers = np.argwhere((tokens[:, 1:-1] >= 1) & (tokens[:, 1:-1] <= 2)) + [0, 1]  # (document, position)
    assert len(triggers) > 4096 * 3  # ~ 0.1 per eligible body position, 3 positions per trigger
    d, j = triggers.T
    assert (tokens[d, j + 1] == tokens[d, j - 1]).all()  # every trigger is followed by a copy of the token before it
    body = tokens[:, 1:].reshape(-1)
    body = body[body > 2]
    share = np.bincount(body, minlength=64)[3:] / body.size
    p = synthetic.body_distribution(64, 2, 1.0)
    assert np.abs(share - p).max() < 0.01 and share[0] == share.max()  # Zipf: id 3 is the most common
    again = synthetic.make_documents(4096, 64, 64, 1.0, triggers=2)
    assert (again == tokens).all()  # same arguments, same tokens


def test_every_training_sample_starts_at_bos(corpus, tmp_path):
    """megatron's GPTDataset, built as the trainer builds it for the shipped config (600 steps x 32 samples: ~5
    epochs of the train split), puts BOS at position 0 of every sample, train and validation."""
    from megagate.data.loader import build_datasets

    cfg = config_reader.load(str(CONFIG), data_overrides(corpus), environment=False)
    t = cfg.train
    train, valid, _ = build_datasets(
        cfg.data.blend,
        tokenizer=cfg.data.tokenizer,
        seq_length=t.seq_length,
        num_samples=(t.train_steps * t.global_batch_size, 2 * t.eval_iters * t.global_batch_size, None),
        split=cfg.data.split,
        seed=cfg.seed,
        cache_dir=tmp_path,
    )
    for dataset in (train, valid):
        assert len(dataset) >= 2 * t.eval_iters * t.global_batch_size
        # every sample starts at offset 0 of a document in megatron's own sample index ...
        assert (dataset.sample_index[:, 1] == 0).all()
        # ... and reading samples gives BOS there and nowhere else (1 in 8, across the epochs)
        for i in range(0, len(dataset), 8):
            tokens = np.asarray(dataset[i]["tokens"])
            assert tokens.shape == (64,) and tokens[0] == synthetic.BOS_ID and (tokens[1:] != synthetic.BOS_ID).all()
    assert len(train) >= t.train_steps * t.global_batch_size > 4 * 4096


@pytest.mark.parametrize(
    "kwargs, args, message",
    [
        (dict(vocab=4, triggers=2), ["--vocab", "4", "--triggers", "2"], "vocab=4: need BOS, the 2 trigger"),
        (dict(length=2), ["--length", "2"], "length=2: need at least 4 tokens"),
        (dict(trigger_rate=0.7), ["--trigger-rate", "0.7"], r"trigger_rate=0.7: must be in \[0, 0.5\)"),
        (dict(zipf=-1.0), ["--zipf", "-1"], "zipf=-1.0: the Zipf exponent must be >= 0"),
    ],
)
def test_bad_settings_are_one_line_errors(kwargs, args, message, tmp_path, capsys):
    settings = dict(documents=10, length=64, vocab=64, zipf=1.0, triggers=0, trigger_rate=0.1) | kwargs
    with pytest.raises(ConfigError, match=message):
        synthetic.make_documents(**settings)
    assert main(["data", "synth", "--out", str(tmp_path / "x"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message.split(":")[0] in err
    assert not (tmp_path / "x").exists()


def test_untrained_model_has_no_sink(corpus, megatron_world):
    """The shipped model at initialisation, probed on 16 documents: near-uniform attention, Sink^0.3_1 = 0."""
    from megagate.model import init
    from megagate.model.build import build_gpt_model, transformer_config
    from megagate.monitor import diagnostics

    mc = config_reader.load(str(CONFIG), data_overrides(corpus), environment=False).model
    model = build_gpt_model(mc, transformer_config(mc))
    init.initialize([model], 0, mc.init_method_std, mc.num_layers)
    docs = np.fromfile(corpus / f"{synthetic.PREFIX_NAME}.bin", dtype=np.uint16).reshape(4096, 64)[:16]
    (layer,) = diagnostics.collect(model, torch.from_numpy(docs.astype(np.int64)))
    uniform = sum(1 / (i + 1) for i in range(1, 64)) / 63  # 0.059
    assert layer.sink == 0.0 < THRESHOLD and layer.sink_length == 64
    assert abs(layer.f_attn - uniform) < 0.02 and layer.f_attn < F_ATTN_THRESHOLD


# --- the shipped config, trained (slow: ~30-45 s of one core) ------------------------------------------------
def train(corpus: Path, out: Path, *overrides: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["train", "--config", str(CONFIG), *data_overrides(corpus), f"output.dir={out}"]
    args += ["checkpoint.save_final=false", *overrides]
    proc = forked.run_cli(args, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())["diagnostics"]


@pytest.fixture(scope="module")
def baseline(corpus, tmp_path_factory) -> dict:
    return train(corpus, tmp_path_factory.mktemp("sink-baseline"))


@pytest.mark.slow
def test_probe_finds_the_baselines_sink(baseline):
    assert baseline["step"] == 600
    assert baseline["sink"] > THRESHOLD  # measured 0.656
    assert baseline["f_attn"] > F_ATTN_THRESHOLD  # measured 0.349
