"""One config reader and one set of layout rules: `train --dry-run`, `submit --dry-run` and `sweep` refuse the same
bad configs with the same one-line message (exit 2, no traceback), and submit/sweep refuse before anything is
rendered, written, queued or run.

Each case runs through `megagate.cli.main` in this process, as the user's command line would.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megagate.cli import main
from megagate.model.kernels import transformer_engine_available

ROOT = Path(__file__).resolve().parents[1]
# tiny dense model (4 heads, 2 query groups, 2 layers, max sequence 128), demo data, micro 4 / global 16, 60 steps
BASE = ROOT / "examples" / "tiny_cpu.yaml"

# The YAML that `megagate submit` once accepted and the trainer refused: parallel sizes only, no data section.
PARALLEL_ONLY = "model:\n  preset: tiny\nparallel:\n  tensor_model_parallel_size: 2\n"

SECTIONS = "model, parallel, train, data, checkpoint, logging, output, monitor, perf, watchdog, straggler, seed"
PARALLEL_KEYS = (
    "account_for_embedding_in_pipeline_split, account_for_loss_in_pipeline_split, context_parallel_size, "
    "expert_model_parallel_size, expert_tensor_parallel_size, num_layers_in_first_pipeline_stage, "
    "num_layers_in_last_pipeline_stage, "
    "pipeline_model_parallel_layout, pipeline_model_parallel_size, sequence_parallel, tensor_model_parallel_size, "
    "virtual_pipeline_model_parallel_size"
)

# (id, config file text or None for BASE, overrides, nodes, ranks per node, the message or, where it lists every
# allowed value or names a temporary path, the part of it that says what is wrong)
CASES = [
    ("unknown-section", None, ["colours.x=1"], 1, 1, f"colours is not a config section; sections: {SECTIONS}"),
    ("unknown-key", None, ["train.colour=red"], 1, 1, "train.colour is not a known key; allowed: adam_beta1,"),
    ("old-key-train-iters", None, ["train.train_iters=50"], 1, 1, "train.train_iters is not a known key; allowed:"),
    ("nested-typo", None, ["model.gate.positon=g1"], 1, 1, "gate.positon is not a gate field; fields: activation,"),
    ("wrong-type", None, ["train.micro_batch_size=two"], 1, 1, "train.micro_batch_size='two' must be an integer"),
    ("not-finite", None, ["train.lr=.inf"], 1, 1, "train.lr=inf must be a finite number"),
    ("bad-gate-preset", None, ["model.gate.preset=g9"], 1, 1, "gate preset 'g9' is unknown; known presets: baseline,"),
    (
        "bad-gate-combination",
        None,
        ["model.gate.position=g5", "model.gate.granularity=headwise"],
        1,
        1,
        "gate.granularity='headwise' is invalid with gate.position='g5'",
    ),
    ("bad-precision", None, ["train.precision=fp16"], 1, 1, "train.precision='fp16' is not one of fp32, bf16, fp8"),
    (
        "heads-vs-tp",
        None,
        ["parallel.tensor_model_parallel_size=3"],
        1,
        3,
        "model.num_attention_heads (4) must be divisible by parallel.tensor_model_parallel_size (3)",
    ),
    (
        "layers-vs-pp",
        None,
        ["parallel.pipeline_model_parallel_size=4"],
        2,
        2,
        "model.num_layers (2) must be divisible by pipeline stages x virtual stages (4)",
    ),
    (
        "ep-without-experts",
        None,
        ["parallel.expert_model_parallel_size=2"],
        1,
        2,
        "parallel.expert_model_parallel_size (2) needs an MoE model (model.num_experts > 0)",
    ),
    (
        "ep-vs-experts",
        None,
        ["model.preset=tiny-moe", "parallel.expert_model_parallel_size=3"],
        1,
        3,
        "parallel.expert_model_parallel_size (3) must divide model.num_experts (4)",
    ),
    (
        "ep-vs-dp-cp",
        None,
        ["model.preset=tiny-moe", "parallel.expert_model_parallel_size=4"],
        1,
        2,
        "parallel.expert_model_parallel_size (4) must divide DP (2) x CP (1) = 2: megatron's expert grid "
        "ETP (1) x EP (4) x PP (1) = 4 must divide world size 2",
    ),
    (
        "sp-without-tp",
        None,
        ["parallel.sequence_parallel=true"],
        1,
        1,
        "parallel.sequence_parallel=true needs tensor_model_parallel_size > 1",
    ),
    (
        "data-parallel-size",
        None,
        ["parallel.data_parallel_size=2"],
        1,
        2,
        f"parallel.data_parallel_size is not a known key; allowed: {PARALLEL_KEYS}",
    ),
    (
        "world-vs-tp",
        None,
        ["parallel.tensor_model_parallel_size=2"],
        3,
        1,
        "world size 3 is not divisible by TP (2) x PP (1) x CP (1) = 2",
    ),
    (
        "global-batch",
        None,
        ["train.global_batch_size=10"],
        2,
        1,
        "train.global_batch_size (10) must be divisible by micro_batch_size (4) x data-parallel size (2) = 8",
    ),
    (
        "vpp-microbatches",
        None,
        [
            "model.num_layers=4",
            "parallel.pipeline_model_parallel_size=2",
            "parallel.virtual_pipeline_model_parallel_size=2",
            "train.global_batch_size=12",
        ],
        1,
        2,
        "train.global_batch_size (12) gives 3 micro-batches per step; the interleaved pipeline schedule "
        "(virtual_pipeline_model_parallel_size=2) needs a multiple of pipeline_model_parallel_size (2)",
    ),
    (
        "seq-length",
        None,
        ["train.seq_length=256"],
        1,
        1,
        "train.seq_length (256) exceeds model.max_sequence_length (128)",
    ),
    (
        "warmup",
        None,
        ["train.warmup_steps=100"],
        1,
        1,
        "train.warmup_steps (100) must be in [0, train.train_steps (60)): warmup must end before the last step "
        "(for a short run also set train.warmup_steps=6)",
    ),
    (  # a short smoke run of an example whose warm-up is longer: refused, with the override that makes it run
        "short-run",
        None,
        ["train.train_steps=3"],
        1,
        1,
        "train.warmup_steps (6) must be in [0, train.train_steps (3)): warmup must end before the last step "
        "(for a short run also set train.warmup_steps=0)",
    ),
    (  # two data sources: refused, not settled by a precedence rule the saved config.yaml would not show
        "demo-and-blend",
        None,
        ["data.blend=[corpus]", "data.tokenizer=t.json"],
        1,
        1,
        "data.demo=true and data.blend name two data sources: set data.demo=false to train on data.blend",
    ),
    ("did-you-mean-key", None, ["train.learning_rate=1e-3"], 1, 1, "wsd_decay_steps, z_loss_coeff; did you mean 'lr'?"),
    (
        "did-you-mean-preset",
        None,
        ["model.gate.preset=g1-elementwize"],
        1,
        1,
        "g1-elementwise-sandwich-norm; did you mean 'g1-elementwise'?",
    ),
    ("min-lr", None, ["train.min_lr=0.1"], 1, 1, "train.min_lr (0.1) must be in [0, train.lr (0.003)]"),
    (
        "missing-data",
        None,
        ["data.demo=false", "data.blend=[/nonexistent/corpus]", "data.tokenizer=t.json"],
        1,
        1,
        "data.blend: missing data file '/nonexistent/corpus.bin' (preprocess with `megagate preprocess`)",
    ),
    (
        "no-data-section",
        PARALLEL_ONLY,
        [],
        2,
        1,
        "data: give data.blend (dataset prefixes), or data.mock=true, or data.demo=true",
    ),
    ("not-a-mapping", "- model\n- parallel\n", [], 1, 1, "must hold a mapping of sections, not list"),
]
if not transformer_engine_available():
    CASES.append(
        (
            "cp-without-te",
            None,
            ["parallel.context_parallel_size=2"],
            1,
            2,
            "parallel.context_parallel_size=2 needs Transformer Engine's attention: set train.backend=te",
        )
    )

# Cases that need no world larger than one process: a local sweep refuses them too.
SWEEP_CASES = (
    "unknown-key",
    "old-key-train-iters",
    "wrong-type",
    "data-parallel-size",
    "seq-length",
    "warmup",
    "ep-without-experts",
    "no-data-section",
)


def config_file(tmp_path: Path, text: str | None) -> str:
    if text is None:
        return str(BASE)
    path = tmp_path / "configs" / "job.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return str(path)


def refused(capsys, argv: list[str]) -> str:
    """The message of a refused command: exit 2, nothing on stdout, one line on stderr, no traceback."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    prefix = f"megagate {argv[0]}: error: "
    assert out == "" and err.startswith(prefix) and err.endswith("\n") and err.count("\n") == 1, (out, err)
    assert "Traceback" not in err
    return err[len(prefix) : -1]


def test_the_base_config_passes_everywhere(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", str(BASE), "--dry-run", "--world-size", "2"]) == 0
    assert "world 2 = TP 1 x PP 1 x CP 1 x DP 2" in capsys.readouterr().out
    assert (
        main(["submit", str(BASE), "--nodes", "2", "--gpus-per-node", "0", "--tasks-per-node", "1", "--dry-run"]) == 0
    )
    assert "# layout: TP=1 PP=1 CP=1 DP=2 world=2" in capsys.readouterr().out.splitlines()
    assert main(["sweep", "--config", str(BASE), "--lrs", "1e-3", "--variants", "baseline", "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith(f"-m megagate train --config {BASE} train.lr=0.001")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_train_and_submit_refuse_alike(case, capsys, tmp_path, monkeypatch):
    _, text, overrides, nodes, per_node, expected = case
    config = config_file(tmp_path, text)
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    world = nodes * per_node
    train = refused(capsys, ["train", "--config", config, "--dry-run", "--world-size", str(world), *overrides])
    # a GPU job of `per_node` GPUs per node, and the same world as a CPU job: the same rules, the same message
    gpu = refused(
        capsys, ["submit", config, *overrides, "--nodes", str(nodes), "--gpus-per-node", str(per_node), "--dry-run"]
    )
    cpu = refused(
        capsys,
        [
            "submit",
            config,
            *overrides,
            "--nodes",
            str(nodes),
            "--gpus-per-node",
            "0",
            "--tasks-per-node",
            str(per_node),
        ],
    )  # no --dry-run: refused before sbatch is looked for
    assert train == gpu == cpu
    assert expected in train, train
    assert list(workdir.iterdir()) == []  # no script, no log folder, no run directory


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in SWEEP_CASES], ids=lambda c: c[0])
def test_sweep_refuses_every_point_before_running(case, capsys, tmp_path, monkeypatch):
    _, text, overrides, _, _, expected = case
    config = config_file(tmp_path, text)
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    train = refused(capsys, ["train", "--config", config, "--dry-run", "--world-size", "1", *overrides])
    grid = ["--config", config, "--lrs", "1e-3,3e-3", "--variants", "baseline,g1-elementwise", "--out", "runs"]
    dry = refused(capsys, ["sweep", *grid, "--dry-run", *overrides])
    real = refused(capsys, ["sweep", *grid, *overrides])  # would run the trainer: refused before the first run
    script = refused(
        capsys, ["sweep", *grid, "--slurm", "--nodes", "1", "--gpus-per-node", "1", "--script", "a.sbatch", *overrides]
    )
    assert dry == real == script == f"sweep point baseline_lr0.001_s0: {train}"
    assert expected in train, train
    assert list(workdir.iterdir()) == []


@pytest.mark.parametrize("lrs, shown", [("inf", "inf"), ("nan", "nan"), ("-1", "-1.0"), ("1e-3,0", "0.0")])
def test_sweep_refuses_bad_learning_rates(lrs, shown, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = refused(capsys, ["sweep", "--config", str(BASE), f"--lrs={lrs}", "--out", "runs"])
    assert message == f"sweep learning rate {shown} must be a positive finite number"
    assert list(tmp_path.iterdir()) == []


def test_sweep_names_the_grid_point_that_clashes(capsys, tmp_path, monkeypatch):
    """A base override that is fine for one variant and not another: the message names the bad point."""
    monkeypatch.chdir(tmp_path)
    message = refused(
        capsys,
        [
            "sweep",
            "--config",
            str(BASE),
            "--lrs",
            "1e-3",
            "--dry-run",
            "--variants",
            "g1-elementwise,g5-elementwise",
            "model.gate.granularity=headwise",
        ],
    )
    assert message.startswith(
        "sweep point g5-elementwise_lr0.001_s0: gate.granularity='headwise' is invalid with gate.position='g5'"
    )


def test_missing_config_file_is_one_message(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    missing = str(tmp_path / "nope.yaml")
    expected = f"config file {missing!r} does not exist"
    assert refused(capsys, ["train", "--config", missing, "--dry-run"]) == expected
    assert refused(capsys, ["submit", missing, "--nodes", "1", "--gpus-per-node", "1", "--dry-run"]) == expected
    assert refused(capsys, ["sweep", "--config", missing, "--lrs", "1e-3", "--dry-run"]) == expected
    assert list(tmp_path.iterdir()) == []
