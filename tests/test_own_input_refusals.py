"""No command destroys or changes its own input: an --out that is the input, lies inside it or (for a command that
replaces --out whole: export, import, a --force) holds it is refused in one line, exit 2, before anything is read or
written — resolved paths, symlinks included (megagate.files.refuse_own_input)."""

from __future__ import annotations

import os

import pytest

from megagate.cli import main


def tree(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def run_dir(tmp_path):
    """A run folder shaped like a trainer's (the refusal comes before anything is read)."""
    run = tmp_path / "run"
    (run / "checkpoints" / "iter_0000004").mkdir(parents=True)
    (run / "checkpoints" / "iter_0000004" / "manifest.json").write_text("{}")
    (run / "config.yaml").write_text("seed: 1\n")
    (tmp_path / "link").symlink_to(run)
    return run


def refused(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "out, why",
    [
        ("{run}", "is the input checkpoint"),
        ("{tmp}/link", "is the input checkpoint"),  # a symlink to the run folder
        ("{run}/checkpoints/iter_0000004", "lies inside the input checkpoint"),
        ("{run}/checkpoints/../checkpoints", "lies inside the input checkpoint"),
        ("{tmp}", "holds the input checkpoint"),
    ],
)
def test_export_refuses_its_own_checkpoint(run_dir, tmp_path, capsys, out, why):
    before = tree(run_dir)
    target = out.format(run=run_dir, tmp=tmp_path)
    err = refused(["export", str(run_dir), "--out", target, "--force"], capsys)
    assert f"--out {target!r} {why} {str(run_dir)!r}" in err, err
    assert tree(run_dir) == before and (run_dir / "checkpoints" / "iter_0000004").is_dir()


def test_import_and_the_other_commands_refuse_their_input(run_dir, tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    err = refused(["import", str(hf), "--out", str(hf), "--force"], capsys)
    assert f"--out {str(hf)!r} is the input folder {str(hf)!r}: choose another --out" in err
    err = refused(["import", str(hf), "--out", str(tmp_path), "--force"], capsys)
    assert "holds the input folder" in err
    ck = run_dir / "checkpoints" / "iter_0000004"
    err = refused(["analyze", str(ck), "--out", str(ck)], capsys)
    assert f"--out {str(ck)!r} is the input checkpoint" in err
    # <run>/eval (eval's default) is beside the checkpoints; inside the checkpoint itself it is refused
    argv = ["eval", str(run_dir), "--seq-lengths", "32", "--data", "demo", "--out", str(ck / "eval")]
    err = refused(argv, capsys)
    assert "lies inside the input checkpoint" in err and "(writing there would change it)" in err
    err = refused(["report", str(run_dir), "--out", str(tmp_path / "link")], capsys)
    assert "is the input run" in err
    err = refused(["calibrate", "--out", ""], capsys)
    assert err.endswith("--out '' is empty: give a file name for the profile"), err
    cfg = run_dir / "config.yaml"
    err = refused(["frontier", "--config", str(cfg), "--lr-range", "1e-3:1e-2", "--out", str(cfg)], capsys)
    assert f"--out {str(cfg)!r} is the input --config" in err
    text = tmp_path / "corpus_text_document.bin"
    text.write_bytes(b"x")
    argv = ["preprocess", "-i", str(text), "-o", str(tmp_path / "corpus"), "-t", str(cfg), "--overwrite"]
    err = refused(argv, capsys)
    assert f"is the input --input {str(text)!r}" in err and text.read_bytes() == b"x"
    assert tree(run_dir)["config.yaml"] == b"seed: 1\n"


def test_an_output_beside_the_input_is_fine(run_dir, tmp_path):
    from megagate.files import refuse_own_input

    refuse_own_input(tmp_path / "hf", [("checkpoint", run_dir)], replaces=True)
    refuse_own_input(tmp_path / "run2", [("checkpoint", run_dir)], replaces=True)  # a shared prefix is not inside
    refuse_own_input(tmp_path, [("checkpoint", run_dir)])  # holds it, but writes files only: nothing is deleted
    assert os.path.isdir(run_dir)


def test_train_gpu_without_dry_run_is_refused(capsys):
    from pathlib import Path

    config = Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml"
    err = refused(["train", "--config", str(config), "--gpu", "h100"], capsys)
    assert err.endswith("--gpu h100 applies with --dry-run only (the memory plan's GPU)"), err


def test_early_stop_rules_that_never_fire_and_a_run_that_never_saves(tmp_path, capsys):
    from pathlib import Path

    config = str(Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml")
    dry = ["train", "--config", config, "--dry-run"]
    err = refused([*dry, "monitor.early_stop.max_loss_spikes=2", "monitor.spike.enabled=false"], capsys)
    assert (
        "monitor.early_stop.max_loss_spikes=2 counts the spike monitor's events, but monitor.spike.enabled=false" in err
    )
    err = refused([*dry, f"monitor.early_stop.control_file={tmp_path}"], capsys)
    assert f"monitor.early_stop.control_file={str(tmp_path)!r} is a folder: name a JSON file" in err
    assert main([*dry, "monitor.early_stop.rungs=[[30, 5.0], [90, 4.0]]", "checkpoint.save_final=false"]) == 0
    err = capsys.readouterr().err
    assert "warning: monitor.early_stop.rungs at steps [90] lie beyond train.train_steps=60" in err
    assert "warning: checkpoint.save_final=false with checkpoint.interval=0" not in err  # interval 30 saves
    assert main([*dry, "checkpoint.save_final=false", "checkpoint.interval=0"]) == 0
    assert (
        "warning: checkpoint.save_final=false with checkpoint.interval=0: this run never saves"
        in capsys.readouterr().err
    )
