"""Write the resume fixtures of tests/train/test_resume_old_checkpoint.py: small distributed checkpoints of the code
at hand, and the losses of continuing each run from them on that same code.

    .venv/bin/python tools/make_resume_fixture.py [--out tests/golden/resume]

For each case (a tiny dense gated-attention GPT, a tiny `GGG*` Gated DeltaNet hybrid with MoE and a gated shared
expert) it trains `STOP` steps of a `STEPS`-step run on mock data (CPU, one process), keeps the checkpoint written
at the stop, then lets the same run continue to its end and records the continued steps' losses. The fixture is
`<case>/config.yaml` (the run's config), `<case>/iter_<STOP>/` (the checkpoint as saved) and `losses.json`.

It was run once, on main before the model moved from megatron's GPTModel to its HybridModel (issue 37): the
checkpoints are in the GPTModel layout (`decoder.layers.N.{self_attention,mlp}`), and a later build must resume them
and continue bit for bit. Rerunning it on newer code overwrites that evidence; do so only on purpose.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS, STOP = 6, 3

# as small as the models allow while keeping what matters: gated attention with QK-norm and RoPE; GDN, MoE with a
# gated shared expert, zero-centred norms, partial rotary and untied embeddings in the hybrid
COMMON = {
    "train": {
        "micro_batch_size": 2,
        "global_batch_size": 4,
        "seq_length": 32,
        "train_steps": STEPS,
        "lr": 3.0e-3,
        "min_lr": 3.0e-4,
        "warmup_steps": 2,
        "eval_interval": 0,
        "eval_iters": 1,
    },
    "data": {"mock": True, "split": "95,5,0"},
    "checkpoint": {"interval": 0},
    "logging": {"interval": 1, "tensorboard": False},
    "seed": 1234,
}
SMALL = {
    "hidden_size": 32,
    "num_attention_heads": 2,
    "num_query_groups": 1,
    "head_dim": 16,
    "vocab_size": 64,
    "max_sequence_length": 32,
}
CASES: dict[str, dict] = {
    "dense": {"preset": "tiny", **SMALL, "ffn_hidden_size": 32, "gate": {"preset": "g1-elementwise"}},
    "hybrid": {
        "preset": "tiny-hybrid",
        **SMALL,
        "ffn_hidden_size": 32,
        "moe_ffn_hidden_size": 8,
        "moe_shared_expert_intermediate_size": 8,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "gate": {"preset": "g1-elementwise"},
    },
}


def config_of(case: str) -> dict:
    """The run config of one case (output.dir is given on the command line)."""
    return {"model": CASES[case], **COMMON}


def train(config: Path, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`megagate train` in a fresh interpreter, one CPU process; a failure is fatal with the run's tail."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "megagate", "train", "--config", str(config), f"output.dir={out}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def train_losses(run_dir: Path) -> dict[int, float]:
    """step -> train loss of a run's metrics.jsonl (its last record of a step wins)."""
    out: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["split"] == "train":
            out[record["step"]] = record["loss"]
    return out


def make(case: str, target: Path, work: Path) -> dict[str, float]:
    """Write `target/<case>/` and return the continued steps' losses (step as a string, JSON's keys)."""
    import yaml

    folder = target / case
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    config = folder / "config.yaml"
    config.write_text(yaml.safe_dump(config_of(case), sort_keys=False))
    run = work / case
    train(config, run, f"train.exit_after_steps={STOP}")
    name = f"iter_{STOP:07d}"
    shutil.copytree(run / "checkpoints" / name, folder / name)
    train(config, run)  # resumes from iter_<STOP> and runs to STEPS
    losses = train_losses(run)
    missing = [s for s in range(STOP + 1, STEPS + 1) if s not in losses]
    if missing:
        sys.exit(f"{case}: the continued run logged no loss for steps {missing}")
    return {str(s): losses[s] for s in range(STOP + 1, STEPS + 1)}


def main(argv: list[str] | None = None) -> None:
    """Make every case's fixture and write losses.json beside them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "golden" / "resume")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    record: dict = {"made_by": "tools/make_resume_fixture.py", "commit": commit, "stop": STOP, "steps": STEPS}
    with tempfile.TemporaryDirectory(prefix="resume-fixture-") as tmp:
        for case in CASES:
            record[case] = make(case, args.out, Path(tmp))
            print(f"{case}: continued losses {record[case]}")
    (args.out / "losses.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
