"""Every bad input a careless user can give any command: exit 2, ONE stderr line naming the bad value, no traceback,
and nothing left under the names the command would have written.

One table (`CASES`) across train, train --dry-run, submit --dry-run, sweep --dry-run, preprocess, data inspect,
tokenizer, analyze, report and variants. Each case runs through `megagate.cli.main` in this process, as the user's
command line would; every refusal must happen while checking the input, before anything is built or trained (no
case here trains: the real `train` cases are refused by `megagate.config_reader.validate`, ahead of the process group).
The fixtures (a 300-token BPE, a small indexed dataset, damaged copies of its files, broken run directories) are
built once per module. Disk-full in preprocess runs in its own test on a real 64 KiB tmpfs.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megagate.cli import main

ROOT = Path(__file__).resolve().parents[1]
BASE = str(ROOT / "examples" / "tiny_cpu.yaml")  # tiny dense model, demo data, 60 steps, warmup 6

TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.\n"
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.\n"
) * 20


@pytest.fixture(scope="module")
def w(tmp_path_factory) -> dict[str, str]:
    """Paths of the inputs the cases use, good and broken (built once; cases must not modify them)."""
    from megagate.data.preprocess import preprocess
    from megagate.data.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("inputs")
    p: dict[str, str] = {"d": str(d), "base": BASE}
    tok = train_bpe([TEXT], d / "tok" / "tokenizer.json", vocab_size=300)
    p["tok"] = str(tok)
    docs = d / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": line}) + "\n" for line in TEXT.splitlines()))
    p["docs"] = str(docs)
    preprocess([str(docs)], str(d / "ds"), str(tok), workers=0, progress=False, log=lambda m: None)
    prefix = d / "ds_text_document"
    p["ds"] = str(prefix)
    # damaged copies of the dataset: each is a prefix with both files present
    for name, mutate in {
        "trunc_idx": lambda b, i: (b, i[:-7]),
        "trunc_bin": lambda b, i: (b[:-3], i),
        "garbage_idx": lambda b, i: (b, b"NOTANIDX" + i[8:]),
        "short_idx": lambda b, i: (b, i[:20]),
    }.items():
        bin_bytes, idx_bytes = mutate(prefix.with_suffix(".bin").read_bytes(), prefix.with_suffix(".idx").read_bytes())
        (d / f"{name}.bin").write_bytes(bin_bytes)
        (d / f"{name}.idx").write_bytes(idx_bytes)
        p[name] = str(d / name)
    shutil.copy(prefix.with_suffix(".bin"), d / "badmeta.bin")
    shutil.copy(prefix.with_suffix(".idx"), d / "badmeta.idx")
    (d / "badmeta.meta.json").write_text('{"tokenizer": ')
    p["badmeta"] = str(d / "badmeta")
    (d / "binary.yaml").write_bytes(bytes(range(128, 256)) * 4)
    p["binary_cfg"] = str(d / "binary.yaml")
    (d / "afile").write_text("a regular file\n")
    p["afile"] = str(d / "afile")
    (d / "empty.txt").write_text("")
    p["empty_txt"] = str(d / "empty.txt")
    (d / "blank.jsonl").write_text("\n\n")
    p["blank_jsonl"] = str(d / "blank.jsonl")
    (d / "bad.jsonl").write_text('{"text": "ok"\n[1, 2]\n{"title": "no text"}\n')
    p["bad_jsonl"] = str(d / "bad.jsonl")
    (d / "data.csv").write_text("a,b\n")
    p["csv"] = str(d / "data.csv")
    gz = gzip.compress(docs.read_bytes())
    (d / "trunc.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    p["trunc_gz"] = str(d / "trunc.jsonl.gz")
    (d / "notok.json").write_text('{"model": 3}')
    p["notok"] = str(d / "notok.json")
    (d / "empty_dir").mkdir()
    p["empty_dir"] = str(d / "empty_dir")
    (d / "odir_text_document.bin").mkdir()  # a directory where an output file would go
    (d / "text.txt").write_text("some text\n")
    p["text"] = str(d / "text.txt")
    # broken run directories for `report`
    good_metrics = '{"step": 1, "split": "train", "loss": 5.0}\n{"step": 2, "split": "train", "loss": 4.0}\n'
    runs = {
        "run_badmetrics": {"metrics.jsonl": '{"step": 1, "split": "train", "loss": 5.0}\n{"step": 2, oops\n{}\n'},
        "run_badsummary": {"metrics.jsonl": good_metrics, "summary.json": '{"steps": 2, "final_loss": '},
        "run_listsummary": {"metrics.jsonl": good_metrics, "summary.json": "[1, 2]"},
        "run_badstep": {"metrics.jsonl": '{"step": "two", "split": "train", "loss": 5.0}\n'},
        "run_badloss": {"metrics.jsonl": '{"step": 2, "split": "train", "loss": "low"}\n'},
        "run_binmetrics": {"metrics.jsonl": b"\xff\xfe\x00garbage\n" * 3},
        "run_badconfig": {"metrics.jsonl": good_metrics, "config.yaml": "model: [unclosed\n"},
        "run_badsummary_loss": {"metrics.jsonl": good_metrics, "summary.json": '{"final_loss": "x"}'},
    }
    for run, files in runs.items():
        (d / run).mkdir()
        for name, content in files.items():
            path = d / run / name
            path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
        p[run] = str(d / run)
    (d / "norun" / "sub").mkdir(parents=True)
    p["norun"] = str(d / "norun")
    # a data cache with an index file cut short (a run killed while megatron wrote it)
    import numpy as np

    cache = d / "run_badcache" / "data_cache"
    cache.mkdir(parents=True)
    np.save(cache / "abc-GPTDataset-train-shuffle_index.npy", np.arange(1000, dtype=np.int64))
    data = (cache / "abc-GPTDataset-train-shuffle_index.npy").read_bytes()
    (cache / "abc-GPTDataset-train-shuffle_index.npy").write_bytes(data[: len(data) // 2])
    (cache / "abc-GPTDataset-train-sample_index.npy").write_bytes(b"")
    p["run_badcache"] = str(d / "run_badcache")
    p["badcache"] = str(cache)
    # Hugging Face folders for `import` / `analyze HF_DIR`: another architecture, a config.json that is not JSON
    (d / "hf_llama").mkdir()
    (d / "hf_llama" / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    p["hf_llama"] = str(d / "hf_llama")
    (d / "hf_badjson").mkdir()
    (d / "hf_badjson" / "config.json").write_text('{"model_type": ')
    p["hf_badjson"] = str(d / "hf_badjson")
    # a device profile whose GEMM rate is negative (everything else well-formed)
    profile = {
        "schema": 1,
        "name": "cpu",
        "kind": "cpu",
        "memory_bytes": 2**34,
        "gemm": {"fp32": {"rate": -1.0, "half": 8.0, "latency": 1e-6}},
        "attention": {"sdpa": {"rate": 1e9, "latency": 1e-5}},
        "memory_bandwidth": 1e10,
        "intra": {"latency": 1e-4, "bandwidth": 1e9},
        "inter": {"latency": 1e-4, "bandwidth": 1e9},
        "host": {
            "per_step": 0.01,
            "per_microbatch": 0.001,
            "per_layer": 0.001,
            "per_layer_gate": 0.0,
            "per_layer_moe": 0.0,
        },
    }
    (d / "bad_profile.json").write_text(json.dumps(profile))
    p["bad_profile"] = str(d / "bad_profile.json")
    # good profiles but for the plan asked: a GPU the table does not know, only fp8 curves for an fp32 run
    from helpers.plan_profiles import cpu_profile
    from megagate.plan.profile import to_dict

    good = to_dict(cpu_profile())
    for name, change in (
        ("unknown_gpu", {"kind": "gpu", "gpu": "h999"}),
        ("fp8_only", {"gemm": {"fp8": good["gemm"]["fp32"]}}),
    ):
        (d / f"{name}.json").write_text(json.dumps({**good, **change}))
        p[f"{name}_profile"] = str(d / f"{name}.json")
    p["good_profile"] = str(d / "good_profile.json")
    (d / "good_profile.json").write_text(json.dumps(good))
    # a Qwen3 config.json with a RoPE scaling megatron cannot build (dynamic NTK)
    from megagate.interop import hf
    from megagate.model import gate as gates
    from megagate.model.presets import model_preset

    (d / "hf_dynamic").mkdir()
    config = {
        **hf.hf_config(model_preset("tiny", gate=gates.preset("baseline")), "qwen3"),
        "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
    }
    del config["rope_parameters"]  # a transformers 4.x config.json
    (d / "hf_dynamic" / "config.json").write_text(json.dumps(config))
    p["hf_dynamic"] = str(d / "hf_dynamic")
    (d / "run_ok").mkdir()
    (d / "run_ok" / "metrics.jsonl").write_text(good_metrics)
    p["run_ok"] = str(d / "run_ok")
    return p


@dataclass(frozen=True)
class Case:
    """argv (with {name} placeholders for the fixture paths and {work}, the case's empty working directory), the
    text the message must contain (the bad value), and paths (under {work} or the fixtures) that must not exist."""

    id: str
    argv: tuple[str, ...]
    value: str
    absent: tuple[str, ...] = field(default=())


def C(id: str, argv: str | list[str], value: str, *absent: str) -> Case:
    return Case(id, tuple(argv.split() if isinstance(argv, str) else argv), value, absent)


DRY = "train --config {base} --dry-run"
TRAIN = "train --config {base}"
SUBMIT = "submit {base} --nodes 1 --gpus-per-node 1 --dry-run"
MOE = str(Path(__file__).resolve().parents[1] / "slurm" / "examples" / "configs" / "15a2b_moe.yaml")
SWEEP = "sweep --config {base} --lrs 1e-3 --variants baseline --dry-run --out {work}/sweep"
PRE = "preprocess --input {docs} --tokenizer {tok} --workers 0 --no-progress --output-prefix"
TOKTRAIN = "tokenizer train --vocab-size 300 --output {work}/tok.json --input"

CASES = [
    # --- config files ---------------------------------------------------------------------------------------------
    C("binary-config", "train --config {binary_cfg} --dry-run", "binary.yaml"),
    C("config-is-dir", "train --config {d} --dry-run", "{d}"),
    C("config-missing", "train --config {work}/nope.yaml --dry-run", "nope.yaml"),
    C("submit-binary-config", "submit {binary_cfg} --nodes 1 --gpus-per-node 1 --dry-run", "binary.yaml"),
    C("sweep-binary-config", "sweep --config {binary_cfg} --lrs 1e-3 --dry-run", "binary.yaml"),
    # --- config values: train --dry-run -----------------------------------------------------------------------------
    C("eval-iters-0", f"{DRY} train.eval_iters=0", "train.eval_iters=0"),
    C("eval-iters-neg", f"{DRY} train.eval_iters=-2", "train.eval_iters=-2"),
    C("logging-interval-0", f"{DRY} logging.interval=0", "logging.interval=0"),
    C("logging-interval-neg", f"{DRY} logging.interval=-1", "logging.interval=-1"),
    C("seed-negative", f"{DRY} seed=-1", "seed=-1"),
    C("seed-too-big", f"{DRY} seed=4294967296", "seed=4294967296"),
    C("seed-string", f"{DRY} seed=abc", "seed='abc'"),
    C("split-no-train", f"{DRY} data.split=0,100,0", "0,100,0"),
    C("split-letters", f"{DRY} data.split=a,b", "a,b"),
    C("split-two-parts", f"{DRY} data.split=1,2", "1,2"),
    C("split-negative", f"{DRY} data.split=-1,1,0", "-1,1,0"),
    C("split-all-zero", f"{DRY} data.split=0,0,0", "0,0,0"),
    C("split-four-parts", f"{DRY} data.split=1,1,1,1", "1,1,1,1"),
    C("split-number", f"{DRY} data.split=100", "data.split=100"),
    C("warmup-equals-steps", f"{DRY} train.warmup_steps=60", "train.warmup_steps (60)"),
    C("warmup-negative", f"{DRY} train.warmup_steps=-1", "train.warmup_steps (-1)"),
    C("wsd-decay-too-long", f"{DRY} train.lr_schedule=wsd train.wsd_decay_steps=61", "train.wsd_decay_steps (61)"),
    C("wsd-decay-zero", f"{DRY} train.lr_schedule=wsd train.wsd_decay_steps=0", "train.wsd_decay_steps (0)"),
    C("checkpoint-interval-neg", f"{DRY} checkpoint.interval=-1", "checkpoint.interval=-1"),
    C("save-final-word", f"{DRY} checkpoint.save_final=sometimes", "checkpoint.save_final='sometimes'"),
    C("eval-interval-neg", f"{DRY} train.eval_interval=-5", "train.eval_interval=-5"),
    C("wall-time-zero", f"{DRY} train.wall_time_limit=0", "train.wall_time_limit=0"),
    C("wall-time-neg", f"{DRY} train.wall_time_limit=-10", "train.wall_time_limit=-10"),
    C("exit-after-zero", f"{DRY} train.exit_after_steps=0", "train.exit_after_steps=0"),
    C("lr-nan", f"{DRY} train.lr=.nan", "train.lr=nan"),
    C("lr-nan-string", f"{DRY} train.lr=nan", "train.lr='nan'"),
    C("lr-zero", f"{DRY} train.lr=0", "train.lr=0"),
    C("lr-negative", f"{DRY} train.lr=-1e-3", "train.lr=-0.001"),
    C("lr-word", f"{DRY} train.lr=fast", "train.lr='fast'"),
    C("lr-inf-string", f"{DRY} train.lr=1e999", "train.lr='1e999'"),
    C("min-lr-negative", f"{DRY} train.min_lr=-1e-5", "train.min_lr (-1e-05)"),
    C("min-lr-above-lr", f"{DRY} train.min_lr=0.1", "train.min_lr (0.1)"),
    C("clip-grad-negative", f"{DRY} train.clip_grad=-1", "train.clip_grad=-1.0"),
    C("clip-grad-inf", f"{DRY} train.clip_grad=.inf", "train.clip_grad=inf"),
    C("weight-decay-negative", f"{DRY} train.weight_decay=-0.1", "train.weight_decay=-0.1"),
    C("beta1-one", f"{DRY} train.adam_beta1=1.0", "train.adam_beta1=1.0"),
    C("beta2-negative", f"{DRY} train.adam_beta2=-0.1", "train.adam_beta2=-0.1"),
    C("eps-zero", f"{DRY} train.adam_eps=0", "train.adam_eps=0.0"),
    C("micro-batch-zero", f"{DRY} train.micro_batch_size=0", "train.micro_batch_size=0"),
    C("train-steps-zero", f"{DRY} train.train_steps=0", "train.train_steps=0"),
    C("keep-last-zero", f"{DRY} checkpoint.keep_last=0", "checkpoint.keep_last=0"),
    C("precision", f"{DRY} train.precision=fp16", "train.precision='fp16'"),
    C("schedule", f"{DRY} train.lr_schedule=step", "train.lr_schedule='step'"),
    C("loader", f"{DRY} data.loader=fast", "data.loader='fast'"),
    C("model-preset", f"{DRY} model.preset=huge", "huge"),
    C("gate-preset", f"{DRY} model.gate.preset=g9", "g9"),
    C("tp-zero", f"{DRY} parallel.tensor_model_parallel_size=0", "tensor_model_parallel_size"),
    C("override-no-equals", f"{DRY} train.lr", "train.lr"),
    C("world-size-zero", f"{DRY} --world-size 0", "0"),
    C("world-size-word", f"{DRY} --world-size two", "two"),
    C("output-dir-is-file", f"{DRY} output.dir={{afile}}", "{afile}"),
    C("output-dir-under-file", f"{DRY} output.dir={{afile}}/run", "{afile}"),
    C("output-dir-read-only", f"{DRY} output.dir=/proc/sys/megagate-run", "/proc/sys"),
    C("checkpoint-dir-is-file", f"{DRY} checkpoint.dir={{afile}}", "{afile}"),
    C("cache-dir-under-file", f"{DRY} data.cache_dir={{afile}}/cache", "{afile}"),
    C("blend-missing", f"{DRY} data.demo=false data.blend=[{{work}}/none] data.tokenizer={{tok}}", "none.bin"),
    C("blend-trunc-idx", f"{DRY} data.demo=false data.blend=[{{trunc_idx}}] data.tokenizer={{tok}}", "trunc_idx.idx"),
    C("blend-trunc-bin", f"{DRY} data.demo=false data.blend=[{{trunc_bin}}] data.tokenizer={{tok}}", "trunc_bin.bin"),
    C("tokenizer-missing", f"{DRY} data.demo=false data.blend=[{{ds}}] data.tokenizer={{work}}/t.json", "t.json"),
    C("no-data", f"{DRY} data.demo=false", "data.blend"),
    C("truncated-cache-file", f"{DRY} output.dir={{run_badcache}}", "abc-GPTDataset-train-sample_index.npy"),
    C("truncated-cache-dir", f"{DRY} data.cache_dir={{badcache}}", "abc-GPTDataset-train-sample_index.npy"),
    C("train-truncated-cache", f"{TRAIN} output.dir={{run_badcache}}", "abc-GPTDataset-train-sample_index.npy"),
    C("split-no-valid", f"{DRY} data.split=100,0,0", "100,0,0"),
    C("wrong-type-float-list", f"{DRY} train.lr=[1]", "train.lr=[1]"),
    C("demo-vocab", f"{DRY} data.demo_vocab_size=100", "data.demo_vocab_size=100"),
    C("amax-history", f"{DRY} train.fp8_amax_history_len=0", "train.fp8_amax_history_len=0"),
    C("z-loss-negative", f"{DRY} train.z_loss_coeff=-0.001", "train.z_loss_coeff=-0.001 must be >= 0"),
    C("z-loss-word", f"{DRY} train.z_loss_coeff=lots", "train.z_loss_coeff='lots' must be a number"),
    C("z-loss-nan", f"{DRY} train.z_loss_coeff=.nan", "train.z_loss_coeff=nan must be a finite number"),
    C("qk-clip", f"{DRY} train.qk_clip_threshold=50", "train.qk_clip_threshold=50 is not supported"),
    C("unknown-key", f"{DRY} train.colour=red", "train.colour"),
    # (moved here from tests/train/test_config_errors.py)
    C("wrong-type-int", f"{DRY} train.micro_batch_size=two", "train.micro_batch_size='two' must be an integer"),
    C("heads-vs-tp", f"{DRY} parallel.tensor_model_parallel_size=3", "parallel.tensor_model_parallel_size (3)"),
    C("global-batch-vs-dp", f"{DRY} train.global_batch_size=10 --world-size 2", "train.global_batch_size (10)"),
    C("world-vs-tp", f"{DRY} parallel.tensor_model_parallel_size=2 --world-size 3", "world size 3"),
    C(
        "gate-combination",
        f"{DRY} model.gate.position=g5 model.gate.granularity=headwise",
        "gate.granularity='headwise'",
    ),
    C("gate-activation", f"{DRY} model.gate.activation=2sigmod", "gate.activation='2sigmod'"),
    C("gate-init", f"{DRY} model.gate.init=ones", "gate.init='ones'"),
    C("gate-input-fraction-range", f"{DRY} model.gate.input_fraction=1.5", "gate.input_fraction=1.5 must be"),
    C("gate-input-fraction-zero", f"{DRY} model.gate.input_fraction=0", "gate.input_fraction=0 must be"),
    C("gate-input-fraction-width", f"{DRY} model.gate.input_fraction=0.3", "gate.input_fraction=0.3 gives"),
    C(
        "gate-input-fraction-independent",
        f"{DRY} model.gate.input=input_independent model.gate.input_fraction=0.5",
        "needs a query-dependent gate",
    ),
    C("gate-2sigmoid-additive", f"{DRY} model.gate.activation=2sigmoid model.gate.combine=additive", "'2sigmoid'"),
    C("ep-without-moe", f"{DRY} parallel.expert_model_parallel_size=2", "expert_model_parallel_size (2)"),
    C("unknown-section", f"{DRY} colours.x=1", "colours is not a config section"),
    C("monitor-typo", f"{DRY} monitor.spike.treshold=3", "monitor.spike.treshold is not a known key"),
    C("monitor-fault-kind", [*DRY.split(), "monitor.faults=[{{step: 3, kind: melt}}]"], "kind='melt'"),
    C("monitor-fault-key", [*DRY.split(), "monitor.faults=[{{step: 3, kind: nan_grad, strength: 2}}]"], "strength"),
    C("monitor-diagnostics-key", f"{DRY} monitor.diagnostics.every=5", "monitor.diagnostics.every"),
    C("sink-epsilon", f"{DRY} monitor.diagnostics.sink_epsilon=1.5", "sink_epsilon=1.5 must be in (0, 1)"),
    C("sink-length", f"{DRY} monitor.diagnostics.sink_length=4096", "sink_length=4096 is longer than train.seq_length"),
    C("monitor-section-key", f"{DRY} monitor.alarm=1", "monitor.alarm is not a known key"),
    # --- the real train command: refused by validation, before any process group or model ----------------------
    C("train-eval-iters-0", f"{TRAIN} train.eval_iters=0 output.dir={{work}}/run", "train.eval_iters=0", "run"),
    C("train-logging-0", f"{TRAIN} logging.interval=0 output.dir={{work}}/run", "logging.interval=0", "run"),
    C("train-split", f"{TRAIN} data.split=0,100,0 output.dir={{work}}/run", "0,100,0", "run"),
    C("train-warmup", f"{TRAIN} train.warmup_steps=60 output.dir={{work}}/run", "train.warmup_steps (60)", "run"),
    C("train-output-file", f"{TRAIN} output.dir={{afile}}", "{afile}"),
    C("train-seed", f"{TRAIN} seed=-1 output.dir={{work}}/run", "seed=-1", "run"),
    # --- submit and sweep share the validator -------------------------------------------------------------------
    C("submit-eval-iters", f"{SUBMIT} train.eval_iters=0", "train.eval_iters=0"),
    C("submit-split", f"{SUBMIT} data.split=a,b", "a,b"),
    C("submit-nodes-zero", "submit {base} --nodes 0 --gpus-per-node 1 --dry-run", "nodes=0"),
    C("submit-time", "submit {base} --nodes 1 --gpus-per-node 1 --time soon --dry-run", "soon"),
    C("submit-env", "submit {base} --nodes 1 --gpus-per-node 1 --env NOEQUALS --dry-run", "NOEQUALS"),
    C("submit-array", "submit {base} --nodes 1 --gpus-per-node 1 --array x-y --dry-run", "x-y"),
    C("submit-nodes-word", "submit {base} --nodes many --dry-run", "many"),
    C("sweep-eval-iters", f"{SWEEP} train.eval_iters=0", "train.eval_iters=0", "sweep"),
    C("sweep-seed", f"{SWEEP} logging.interval=0", "logging.interval=0", "sweep"),
    C("sweep-lrs-word", "sweep --config {base} --lrs fast --dry-run", "fast"),
    C("sweep-lrs-inf", "sweep --config {base} --lrs inf --dry-run", "inf"),
    C("sweep-variant", "sweep --config {base} --lrs 1e-3 --variants g9 --dry-run", "g9"),
    C("sweep-seeds-word", "sweep --config {base} --lrs 1e-3 --seeds x --dry-run", "x"),
    C("sweep-seeds-negative", "sweep --config {base} --lrs 1e-3 --seeds -1 --dry-run", "-1"),
    # --- preprocess -------------------------------------------------------------------------------------------------
    C(
        "pre-missing-input",
        "preprocess --input {work}/no.jsonl --tokenizer {tok} -o {work}/o",
        "no.jsonl",
        "o_text_document.bin",
    ),
    C("pre-csv-input", "preprocess --input {csv} --tokenizer {tok} -o {work}/o", "data.csv", "o_text_document.bin"),
    C(
        "pre-empty-folder",
        "preprocess --input {empty_dir} --tokenizer {tok} -o {work}/o",
        "empty_dir",
        "o_text_document.bin",
    ),
    C(
        "pre-missing-tokenizer",
        "preprocess --input {docs} --tokenizer {work}/t.json -o {work}/o",
        "t.json",
        "o_text_document.bin",
    ),
    C(
        "pre-unknown-tokenizer",
        "preprocess --input {docs} --tokenizer {csv} -o {work}/o",
        "data.csv",
        "o_text_document.bin",
    ),
    C(
        "pre-garbage-tokenizer",
        "preprocess --input {docs} --tokenizer {notok} -o {work}/o",
        "notok.json",
        "o_text_document.bin",
    ),
    C("pre-output-under-file", f"{PRE} {{afile}}/o", "{afile}"),
    C("pre-output-read-only", f"{PRE} /proc/sys/megagate-o", "/proc/sys"),
    C("pre-output-is-dir", f"{PRE} {{d}}/odir", "odir_text_document.bin"),
    C("pre-workers-negative", f"{PRE} {{work}}/o --workers -1", "-1", "o_text_document.bin"),
    C("pre-text-mode", f"{PRE} {{work}}/o --text-mode para", "para", "o_text_document.bin"),
    C("pre-bad-lines", f"{PRE} {{work}}/o --bad-lines ignore", "ignore", "o_text_document.bin"),
    C("pre-engine", f"{PRE} {{work}}/o --engine turbo", "turbo", "o_text_document.bin"),
    C("pre-json-key-slash", [*PRE.split(), "{work}/o", "--json-keys", "a/b"], "a/b", "o_a/b_document.bin"),
    C("pre-chunk-mb", f"{PRE} {{work}}/o --chunk-mb 0", "chunk", "o_text_document.bin"),
    C("pre-chunk-mb-nan", f"{PRE} {{work}}/o --chunk-mb nan", "nan", "o_text_document.bin"),
    C(
        "pre-empty-input",
        "preprocess --input {empty_txt} --tokenizer {tok} -o {work}/o --workers 0",
        "empty.txt",
        "o_text_document.bin",
    ),
    C(
        "pre-blank-jsonl",
        "preprocess --input {blank_jsonl} --tokenizer {tok} -o {work}/o --workers 0",
        "blank.jsonl",
        "o_text_document.bin",
    ),
    C(
        "pre-bad-record-error",
        "preprocess --input {bad_jsonl} --tokenizer {tok} -o {work}/o --workers 0 --bad-lines error",
        "bad.jsonl:1",
        "o_text_document.bin",
    ),
    C(
        "pre-truncated-gz",
        "preprocess --input {trunc_gz} --tokenizer {tok} -o {work}/o --workers 0",
        "trunc.jsonl.gz",
        "o_text_document.bin",
    ),
    C("pre-eod-token", f"{PRE} {{work}}/o --eod-token <|nope|>", "<|nope|>", "o_text_document.bin"),
    # --- data inspect -----------------------------------------------------------------------------------------------
    C("inspect-missing", "data inspect {work}/none", "none.idx"),
    C("inspect-trunc-idx", "data inspect {trunc_idx}", "trunc_idx.idx"),
    C("inspect-trunc-bin", "data inspect {trunc_bin}", "trunc_bin.bin"),
    C("inspect-garbage-idx", "data inspect {garbage_idx}", "garbage_idx.idx"),
    C("inspect-short-idx", "data inspect {short_idx}", "short_idx.idx"),
    C("inspect-bad-meta", "data inspect {badmeta}", "badmeta.meta.json"),
    C("inspect-document-range", "data inspect {ds} --tokenizer {tok} --document 999", "999"),
    C("inspect-document-negative", "data inspect {ds} --tokenizer {tok} --document -1", "-1"),
    C("inspect-missing-tokenizer", "data inspect {ds} --tokenizer {work}/t.json", "t.json"),
    C("inspect-garbage-tokenizer", "data inspect {ds} --tokenizer {notok}", "notok.json"),
    C("inspect-max-chars", "data inspect {ds} --tokenizer {tok} --max-chars -5", "-5"),
    C("inspect-prefix-is-dir", "data inspect {d}", "{d}"),
    # --- tokenizer --------------------------------------------------------------------------------------------------
    C("tok-empty-input", f"{TOKTRAIN} {{empty_txt}}", "empty.txt", "tok.json"),
    C("tok-blank-jsonl", f"{TOKTRAIN} {{blank_jsonl}}", "blank.jsonl", "tok.json"),
    C("tok-only-bad-records", f"{TOKTRAIN} {{bad_jsonl}}", "bad.jsonl", "tok.json"),
    C("tok-missing-input", f"{TOKTRAIN} {{work}}/none.txt", "none.txt", "tok.json"),
    C("tok-csv-input", f"{TOKTRAIN} {{csv}}", "data.csv", "tok.json"),
    C("tok-vocab-small", "tokenizer train --vocab-size 10 --output {work}/tok.json --input {text}", "10", "tok.json"),
    C(
        "tok-min-frequency",
        "tokenizer train --min-frequency 0 --output {work}/tok.json --input {text}",
        "0",
        "tok.json",
    ),
    C("tok-output-under-file", "tokenizer train --vocab-size 300 --output {afile}/tok.json --input {text}", "{afile}"),
    C(
        "tok-output-read-only",
        "tokenizer train --vocab-size 300 --output /proc/sys/tok.json --input {text}",
        "/proc/sys",
    ),
    C(
        "tok-text-mode",
        "tokenizer train --text-mode para --output {work}/tok.json --input {text}",
        "para",
        "tok.json",
    ),
    C("tok-truncated-gz", f"{TOKTRAIN} {{trunc_gz}}", "trunc.jsonl.gz", "tok.json"),
    C("tok-verify-missing", "tokenizer verify {work}/t.json", "t.json"),
    C("tok-verify-garbage", "tokenizer verify {notok}", "notok.json"),
    # --- report -----------------------------------------------------------------------------------------------------
    C("report-missing", "report {work}/runs", "runs"),
    C("report-no-runs", "report {norun}", "norun"),
    C("report-empty-dir", "report {empty_dir}", "empty_dir"),
    C("report-bad-metrics", "report {run_badmetrics}", "metrics.jsonl:2"),
    C("report-bad-summary", "report {run_badsummary}", "summary.json"),
    C("report-list-summary", "report {run_listsummary}", "summary.json"),
    C("report-bad-step", "report {run_badstep}", "two"),
    C("report-bad-loss", "report {run_badloss}", "low"),
    C("report-binary-metrics", "report {run_binmetrics}", "metrics.jsonl"),
    C("report-bad-config", "report {run_badconfig}", "config.yaml"),
    C("report-summary-loss", "report {run_badsummary_loss}", "final_loss"),
    C("report-out-is-file", "report {run_ok} --out {afile}", "{afile}"),
    # --- analyze, variants ----------------------------------------------------------------------------------------
    C("analyze-missing-checkpoint", "analyze {work}/ckpt", "ckpt", "analysis"),
    C("analyze-seq-len", "analyze {work}/ckpt --seq-len 1", "1", "analysis"),
    C("analyze-text-missing", "analyze {work}/ckpt --text {work}/none.txt", "none.txt", "analysis"),
    # --- export / import / analyze HF_DIR (cases needing a checkpoint: tests/interop/test_export_import.py) -------
    C("export-missing-checkpoint", "export {work}/ckpt --out {work}/hf", "ckpt", "hf"),
    C("export-unknown-format", "export {work}/ckpt --format gguf --out {work}/hf", "gguf", "hf"),
    C("export-dtype", "export {work}/ckpt --dtype float8 --out {work}/hf", "float8", "hf"),
    C("export-shard-size", "export {work}/ckpt --max-shard-size big --out {work}/hf", "big", "hf"),
    C("export-out-not-empty", "export {work}/ckpt --out {d}", "{d}"),
    C("export-no-out", "export {work}/ckpt", "--out"),
    C("import-missing-folder", "import {work}/nohf --out {work}/ck", "nohf", "ck"),
    C("import-no-config-json", "import {empty_dir} --out {work}/ck", "config.json", "ck"),
    C("import-config-not-json", "import {hf_badjson} --out {work}/ck", "config.json", "ck"),
    C("import-model-type", "import {hf_llama} --out {work}/ck", "llama", "ck"),
    C("import-unknown-format", "import {hf_llama} --format gguf --out {work}/ck", "gguf", "ck"),
    C("import-out-not-empty", "import {hf_llama} --out {d}", "{d}"),
    C("import-rope-dynamic", "import {hf_dynamic} --out {work}/ck", "rope_type='dynamic'", "ck"),
    C("analyze-hf-model-type", "analyze {hf_llama}", "llama", "analysis"),
    # --- eval (the cases that need a trained checkpoint are in tests/eval/test_eval.py) ---------------------------
    C("eval-missing-checkpoint", "eval {work}/ckpt --data {ds} --seq-lengths 16", "ckpt", "eval"),
    C("eval-rope-unknown-key", "eval {work}/ckpt --data {ds} --seq-lengths 16 --rope rotary_speed=2", "rotary_speed"),
    C("eval-rope-architecture", "eval {work}/ckpt --data {ds} --seq-lengths 16 --rope head_dim=32", "head_dim"),
    C("eval-rope-not-a-number", "eval {work}/ckpt --data {ds} --seq-lengths 16 --rope yarn_factor=big", "big"),
    C("eval-rope-no-value", "eval {work}/ckpt --data {ds} --seq-lengths 16 --rope rotary_base", "rotary_base"),
    C("eval-too-few-tokens", "eval {work}/ckpt --data {ds} --seq-lengths 16,100000", "100000", "eval"),
    C("eval-seq-lengths", "eval {work}/ckpt --data {ds} --seq-lengths 64,x", "x"),
    C("eval-seq-length-one", "eval {work}/ckpt --data {ds} --seq-lengths 1", "1"),
    C("eval-data-missing", "eval {work}/ckpt --data {work}/none --seq-lengths 16", "none"),
    C("eval-data-damaged", "eval {work}/ckpt --data {trunc_bin} --seq-lengths 16", "trunc_bin"),
    C("eval-samples-zero", "eval {work}/ckpt --data {ds} --seq-lengths 16 --samples 0", "0"),
    C("train-position-embedding", f"{TRAIN} model.position_embedding=alibi", "alibi"),
    C("train-yarn-without-yarn", f"{TRAIN} model.yarn_factor=4", "yarn_factor"),
    C(
        "train-llama3-without-scaling",
        f"{TRAIN} model.rope_scaling_original_max_position_embeddings=128",
        "rope_scaling",
    ),
    C("train-llama3-bands", f"{TRAIN} model.rope_scaling=true model.rope_scaling_high_freq_factor=0.5", "0.5"),
    C("variants-model", "variants --models huge", "huge"),
    C("variants-variant", "variants --variants g9", "g9"),
    # --- plan, and the memory plan of submit / train --dry-run -----------------------------------------------------
    C("plan-nodes-zero", "plan {base} --nodes 0", "0"),
    C("plan-gpu", "plan {base} --nodes 1 --gpu h999", "h999"),
    C("plan-profile-missing", "plan {base} --nodes 1 --profile {work}/none.json", "none.json"),
    C("plan-profile-not-json", "plan {base} --nodes 1 --profile {base}", "not a JSON device profile"),
    C("plan-profile-bad-field", "plan {base} --nodes 1 --profile {bad_profile}", "gemm.fp32.rate"),
    C("plan-imbalance", "plan {base} --nodes 1 --routing-imbalance 0.5", "0.5"),
    C("plan-profile-unknown-gpu", "plan {base} --nodes 1 --profile {unknown_gpu_profile}", "gpu='h999'"),
    C("plan-profile-fp8-only", "plan {base} --nodes 1 --profile {fp8_only_profile}", "fp8 only"),
    C("plan-profile-fp8-only-with-gpu", "plan {base} --nodes 1 --profile {fp8_only_profile} --gpu h200", "fp8 only"),
    C("eval-seed", "eval {work}/ckpt --seq-lengths 32 --data @run --seed -1", "--seed -1"),
    C("eval-buckets", "eval {work}/ckpt --seq-lengths 32 --data @run --buckets 64", "--buckets 64"),
    C("export-shard-negative", "export {work}/ckpt --out {work}/hf --max-shard-size -1GB", "-1GB", "hf"),
    C("calibrate-budget", "calibrate --budget-s 0 --out {work}/p.json", "0", "p.json"),
    C("calibrate-out-folder", "calibrate --out {work}", "folder"),
    C("calibrate-out-missing-folder", "calibrate --out {work}/no/p.json", "does not exist"),
    C("plan-margin", "plan {base} --nodes 1 --margin-gb -1", "-1"),
    C("plan-bandwidth", "plan {base} --nodes 1 --inter-node-gbs 0", "0"),
    C("plan-top", "plan {base} --nodes 1 --search --top 0", "0"),
    C("plan-layout", "plan {base} --nodes 1 --gpus-per-node 3", "3"),
    C("plan-missing-config", "plan {work}/none.yaml --nodes 1", "none.yaml"),
    C(
        "submit-predicted-oom",
        f"submit {MOE} --nodes 8 --gpus-per-node 8 --dry-run train.backend=local perf.core_attention=local",
        "predicted out of memory",
    ),
    C("submit-gpu", "submit {base} --nodes 1 --gpus-per-node 1 --gpu h999 --dry-run", "h999"),
    C("dry-run-gpu", f"{DRY} --gpu h999", "h999"),
    C("dry-run-gpus-per-node", f"{DRY} --gpus-per-node 0", "0"),
    # --- top level ----------------------------------------------------------------------------------------------
    C("unknown-flag", f"{DRY} --colour red", "--colour"),
]


def _fill(text: str, paths: dict[str, str]) -> str:
    return text.format(**paths)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line(case: Case, w, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    paths = {**w, "work": str(work)}
    argv = [_fill(a, paths) for a in case.argv]
    before = sorted(os.listdir(w["d"]))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse's own exit would escape main(): that is a failure of this table
            rc = f"SystemExit({exc.code})"
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith(f"megagate {argv[0]}: error: "), lines[0]
    value = _fill(case.value, paths)
    assert value in lines[0], (value, lines[0])
    assert sorted(os.listdir(w["d"])) == before  # nothing written next to the inputs
    for rel in case.absent:
        assert not (work / rel).exists(), rel
    assert not [p for p in work.rglob("*") if p.is_file()], list(work.rglob("*"))


def test_table_is_large_and_distinct():
    assert len(CASES) >= 80
    assert len({c.id for c in CASES}) == len(CASES)
    assert len({c.argv for c in CASES}) == len(CASES)
    commands = {c.argv[0] + (" --dry-run" if "--dry-run" in c.argv else "") for c in CASES}
    for command in (
        "train",
        "train --dry-run",
        "submit --dry-run",
        "sweep --dry-run",
        "preprocess",
        "data",
        "tokenizer",
        "analyze",
        "export",
        "import",
        "report",
        "variants",
        "plan",
        "calibrate",
    ):
        assert command in commands, command


def test_numbers_written_as_yaml_strings_are_numbers(capsys, tmp_path, monkeypatch):
    """YAML 1.1 reads `3e-4` (no dot) as a string: a float setting takes it as the number it spells."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", BASE, "--dry-run", "train.lr=3e-4", "train.min_lr=1e-5"]) == 0
    assert "lr 0.0003 (cosine, warmup 6, min 1e-05)" in capsys.readouterr().out


def test_damaged_data_cache_is_refused_by_the_dataset_builder(w, tmp_path):
    """A real megatron cache, one index file cut short: the builder names the file instead of reading garbage;
    once deleted, the entry is rebuilt and the same samples come back."""
    from megagate.data.loader import build_datasets
    from megagate.data.tokenizer import load_tokenizer
    from megagate.errors import ConfigError

    tok = load_tokenizer(w["tok"])
    kw = dict(tokenizer=tok, seq_length=16, num_samples=(8, 2, None), split="90,10,0", cache_dir=tmp_path / "cache")
    train, _, _ = build_datasets([w["ds"]], **kw)
    first = [train[i]["tokens"].tolist() for i in range(4)]
    shuffle = sorted((tmp_path / "cache").glob("*GPTDataset-train-shuffle_index.npy"))
    assert len(shuffle) == 1
    shuffle[0].write_bytes(shuffle[0].read_bytes()[:-8])
    with pytest.raises(ConfigError, match=f"data cache file '{shuffle[0]}' is damaged .*; delete it"):
        build_datasets([w["ds"]], **kw)
    shuffle[0].unlink()
    train, _, _ = build_datasets([w["ds"]], **kw)
    assert [train[i]["tokens"].tolist() for i in range(4)] == first


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare -rm (user and mount namespaces) to mount a tmpfs")
def test_preprocess_on_a_full_disk_is_one_line_and_leaves_nothing(w, tmp_path):
    """A real 64 KiB tmpfs: the tokens do not fit. One line naming the file, exit 2, and the folder is empty."""
    text = tmp_path / "big.txt"
    words = TEXT.split()
    text.write_text(" ".join(words[i % len(words)] + str(i % 97) for i in range(60_000)))
    disk = tmp_path / "disk"
    disk.mkdir()
    listing = tmp_path / "listing"
    script = (
        f"mount -t tmpfs -o size=64k none {disk} || exit 99; "
        f"{sys.executable} -m megagate preprocess --input {text} --tokenizer {w['tok']} --workers 0 --no-progress "
        f"--output-prefix {disk}/out; rc=$?; ls -A {disk} > {listing}; exit $rc"
    )
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.splitlines()
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1, lines
    assert lines[0].startswith("megagate preprocess: error: No space left on device"), lines[0]
    assert f"'{disk}/out_text_document." in lines[0], lines[0]
    assert listing.read_text() == ""  # no .bin/.idx/.meta.json, no temporary files


def test_operating_system_errors_are_one_line_and_bugs_keep_their_traceback():
    """`megagate.cli` turns an OSError about a path into one line; one without errno or path is a bug: re-raised."""
    import errno

    from megagate.cli import os_error_message

    assert os_error_message(PermissionError(errno.EACCES, "Permission denied", "/data/x.bin")) == (
        "Permission denied: '/data/x.bin'"
    )
    assert os_error_message(OSError(errno.EXDEV, "Invalid cross-device link", "/a", None, "/b")) == (
        "Invalid cross-device link: '/a' -> '/b'"
    )
    assert os_error_message(OSError(errno.ENOSPC, "No space left on device", "/full/out.bin")) == (
        "No space left on device (free some space or write elsewhere): '/full/out.bin'"
    )
    assert os_error_message(OSError("short write")) is None
    assert os_error_message(OSError(errno.EIO, "Input/output error")) is None
