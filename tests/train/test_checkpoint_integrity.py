"""Checkpoint integrity: manifests, resume past damaged checkpoints, free space, and files that must not run code.

Fast tests check the pieces (the data-only scanner on real torch DCP files and crafted pickles, the RNG state's
round trip through `torch.load(weights_only=True)`, manifest verification, the size estimate). The slow ones damage
the checkpoints of a real tiny run (`megagate train`) and rerun it: the rerun must move each damaged checkpoint
aside with a one-line warning, resume from the newest good one and end bitwise equal to the uninterrupted run; a
crafted pickle must be refused without running; saves on a real tmpfs that is too small must fail in one line and
leave the last good checkpoint as it was.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import forked
from helpers import tiny_runs as T
from megagate import checkpoint as ckpt
from megagate.checkpoint import safe_files


class RunsCode:
    """Unpickling this calls os.system (what a crafted checkpoint file would do): it touches `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# --- the data-only scanner -----------------------------------------------------------------------------------------
def _dcp_checkpoint(folder: Path, obj: object) -> Path:
    """A real torch DCP checkpoint (one process) of a tensor and a non-tensor object (stored as a byte item)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(6.0).reshape(2, 3), "obj": obj}, checkpoint_id=str(folder), no_dist=True)
    return folder


def test_scanner_accepts_real_dcp_checkpoint_files(tmp_path: Path) -> None:
    folder = _dcp_checkpoint(tmp_path / "ok", ("param_groups", 0.1, (0.9, 0.95), None))
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(), "key": torch.arange(3)}, folder / "r.pt")
    safe_files.check_checkpoint(folder)  # no error: everything in it is data
    metadata = safe_files.load_metadata_pickle(folder / ".metadata")
    assert {"w", "obj"} <= set(metadata.state_dict_metadata)
    assert [key for key, _ in safe_files._byte_items(metadata)] == ["obj"]


def test_crafted_metadata_pickle_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    payload = pickle.dumps(RunsCode(marker))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(payload)
    with pytest.raises(safe_files.UnsafeFileError) as err:
        safe_files.check_checkpoint(folder)
    assert str(err.value) == f"refusing to load {folder / '.metadata'}: it references posix.system, which is not data"
    assert not marker.exists()
    pickle.loads(payload)  # what torch's DCP reader (plain pickle.load) would have done with it
    assert marker.exists()


@pytest.mark.parametrize("name", ["rng_0.pt", "common.pt"])
def test_crafted_torch_file_is_refused_without_running(tmp_path: Path, name: str) -> None:
    marker = tmp_path / "ran"
    folder = tmp_path / "ckpt"
    folder.mkdir()
    torch.save({"torch": torch.zeros(3), "evil": RunsCode(marker)}, folder / name)
    with pytest.raises(safe_files.UnsafeFileError, match=rf"refusing to load .*{name}: it references posix.system"):
        safe_files.check_checkpoint(folder)
    assert not marker.exists()


def test_crafted_byte_item_inside_a_shard_is_refused(tmp_path: Path) -> None:
    """torch's DCP planner reads byte items with torch.load(weights_only=False): each is checked first."""
    marker = tmp_path / "ran"
    folder = _dcp_checkpoint(tmp_path / "ckpt", RunsCode(marker))
    with pytest.raises(safe_files.UnsafeFileError, match=r"__0_0\.distcp \(item obj\): it references posix\.system"):
        safe_files.check_checkpoint(folder)
    assert not marker.exists()


def test_unreadable_files_are_damage_not_refusals(tmp_path: Path) -> None:
    folder = _dcp_checkpoint(tmp_path / "ckpt", {"a": 1})
    data = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(safe_files.DamagedFileError, match=r"\.metadata: not a readable pickle"):
        safe_files.check_checkpoint(folder)
    (folder / ".metadata").write_bytes(data)
    shard = folder / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:10])  # the byte item is cut off
    with pytest.raises(safe_files.DamagedFileError, match="cut off"):
        safe_files.check_checkpoint(folder)
    (folder / "rng_0.pt").write_bytes(b"not a zip file")
    with pytest.raises(safe_files.DamagedFileError, match="rng_0.pt: not a readable torch file"):
        safe_files.check_checkpoint(folder)


def test_rng_state_round_trips_through_weights_only_load(tmp_path: Path, megatron_world) -> None:
    torch.manual_seed(3), np.random.seed(4), random.seed(5)
    np.random.standard_normal()  # a cached gaussian in numpy's state
    torch.save(ckpt.rng_state(), tmp_path / "rng_0.pt")
    expected = (torch.rand(4), np.random.standard_normal(3), random.random())
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    ckpt.set_rng_state(torch.load(tmp_path / "rng_0.pt", weights_only=True))
    again = (torch.rand(4), np.random.standard_normal(3), random.random())
    assert torch.equal(expected[0], again[0])
    assert (expected[1] == again[1]).all() and expected[2] == again[2]


# --- manifest verification and the size estimate --------------------------------------------------------------------
def _fake_checkpoint(folder: Path) -> Path:
    """A folder with the required file names and a manifest of them, as `Checkpointer.save` writes it."""
    folder.mkdir(parents=True)
    for name, size in [(".metadata", 100), ("__0_0.distcp", 5000), ("metadata.json", 10), ("megagate.json", 20)]:
        (folder / name).write_bytes(os.urandom(size))
    (folder / "rng_0.pt").write_bytes(os.urandom(30))
    names = sorted(p.name for p in folder.iterdir())
    files = {n: {"size": (folder / n).stat().st_size, "crc32": zlib.crc32((folder / n).read_bytes())} for n in names}
    manifest = {"step": 4, "world_size": 1, "total_bytes": sum(r["size"] for r in files.values()), "files": files}
    (folder / ckpt.MANIFEST).write_text(json.dumps(manifest))
    return folder


def test_verify_names_the_file_and_the_damage(tmp_path: Path) -> None:
    folder = _fake_checkpoint(tmp_path / "iter_0000004")
    assert ckpt.verify(folder, collective=False) is None
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[2500] ^= 0x01  # one bit, same size
    shard.write_bytes(bytes(data))
    assert ckpt.verify(folder, collective=False) == "__0_0.distcp: checksum differs from the manifest (same size 5000)"
    shard.write_bytes(bytes(data[:1234]))
    assert ckpt.verify(folder, collective=False) == "__0_0.distcp: size 1234, manifest says 5000"
    shard.unlink()
    assert ckpt.verify(folder, collective=False) == "__0_0.distcp: missing"
    folder = _fake_checkpoint(tmp_path / "iter_0000008")
    (folder / "common.pt").write_bytes(b"x")  # megatron would read a legacy common.pt: it must be listed
    assert ckpt.verify(folder, collective=False) == "common.pt: not in the manifest (added after the save)"
    folder = _fake_checkpoint(tmp_path / "iter_0000012")
    (folder / ckpt.MANIFEST).unlink()
    assert "manifest.json: missing" in ckpt.verify(folder, collective=False)
    assert [p.name for _, p in ckpt.complete_checkpoints(tmp_path)] == ["iter_0000004", "iter_0000008"]


def test_size_estimate_from_tensors_then_from_the_previous_manifest(tmp_path: Path, megatron_world) -> None:
    chunks = [torch.nn.Linear(100, 30), torch.nn.Linear(30, 7, dtype=torch.bfloat16)]
    params = 100 * 30 + 30 + 30 * 7 + 7
    model_bytes = (100 * 30 + 30) * 4 + (30 * 7 + 7) * 2
    root = tmp_path / "ckpts"
    assert ckpt.estimate_bytes(root, chunks, None) == (model_bytes, "from the model and optimizer tensors")
    estimate, _ = ckpt.estimate_bytes(root, chunks, optimizer=object())
    assert estimate == model_bytes + 12 * params  # fp32 main copy + two Adam moments per parameter
    previous = _fake_checkpoint(tmp_path / "ckpts" / "iter_0000004")
    total = json.loads((previous / ckpt.MANIFEST).read_text())["total_bytes"]
    assert ckpt.estimate_bytes(root, chunks, object()) == (total, "the size of iter_0000004")


# --- real runs ------------------------------------------------------------------------------------------------------
STEPS_EVERY = ["checkpoint.interval=3", "checkpoint.keep_last=4"]  # checkpoints of steps 3, 6, 9 and 12


@pytest.fixture(scope="module")
def demo_dir(session_demo_dir: Path) -> Path:
    return session_demo_dir


@pytest.fixture(scope="module")
def reference(reference_run: Path) -> Path:
    """The uninterrupted 12-step run (checkpoints only at the end), what every resumed run must equal (conftest's)."""
    return reference_run


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, demo_dir: Path) -> Path:
    """A finished 12-step run with checkpoints at steps 3, 6, 9 and 12 (copied, then damaged, by each test)."""
    out = tmp_path_factory.mktemp("base")
    T.run_train(out, demo_dir, *STEPS_EVERY)
    assert [p.name for _, p in ckpt.complete_checkpoints(out / "checkpoints")] == [
        "iter_0000003",
        "iter_0000006",
        "iter_0000009",
        "iter_0000012",
    ]
    return out


def _copy(base: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base, run)
    (run / "metrics.jsonl").unlink()  # only the rerun's losses are compared
    return run


def _truncate_shard(path: Path) -> str:
    shard = path / "__0_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size // 3)
    return f"__0_0.distcp: size {size // 3}, manifest says {size}"


def _delete(name: str):
    def damage(path: Path) -> str:
        (path / name).unlink()
        return f"{name}: missing"

    return damage


def _flip_bit_in_shard(path: Path) -> str:
    shard = path / "__0_0.distcp"
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)  # inside a weight tensor: torch's DCP would load it without a word
        byte = f.read(1)
        f.seek(-1, io.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    return f"__0_0.distcp: checksum differs from the manifest (same size {shard.stat().st_size})"


def _corrupt_megagate_json(path: Path) -> str:
    meta = path / ckpt.META
    meta.write_text(meta.read_text().replace('"step"', '"stop"'))
    return f"{ckpt.META}: "


def _unloadable_but_listed(path: Path) -> str:
    """Damage the manifest cannot see (the manifest was rewritten to match): loading it must fail, and fall back."""
    meta = json.loads((path / ckpt.META).read_text())
    del meta["scheduler"]
    (path / ckpt.META).write_text(json.dumps(meta))
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    data = (path / ckpt.META).read_bytes()
    manifest["files"][ckpt.META] = {"size": len(data), "crc32": zlib.crc32(data)}
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    return "loading it failed: KeyError: 'scheduler'"


def _assert_same_as_reference(run: Path, reference: Path, resumed_at: int, tmp_path: Path) -> None:
    ours, theirs = T.losses(run), T.losses(reference)
    assert sorted(ours) == list(range(resumed_at + 1, 13))
    assert ours == {step: theirs[step] for step in ours}  # bitwise equal floats
    mine = T.checkpoint_tensors(run / "checkpoints" / "iter_0000012", tmp_path)
    final = T.checkpoint_tensors(reference / "checkpoints" / "iter_0000012", tmp_path)
    assert mine.keys() == final.keys() and len(mine) >= 9
    for key in mine:
        assert torch.equal(mine[key], final[key]), key


def _stderr_lines(proc: subprocess.CompletedProcess, start: str) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith(start)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "damages",
    [
        # newest first: (checkpoint step, damage); the rerun resumes from the newest undamaged one
        [(12, _truncate_shard), (9, _delete(".metadata")), (6, _flip_bit_in_shard)],
        [(12, _delete("__0_0.distcp")), (9, _delete("rng_0.pt")), (6, _corrupt_megagate_json)],
        [(12, _unloadable_but_listed)],
    ],
    ids=["truncated-shard,no-.metadata,bit-flip", "no-shard,no-rng,bad-megagate.json", "manifest-ok-load-fails"],
)
def test_rerun_moves_damaged_checkpoints_aside_and_resumes_bitwise(reference, base, tmp_path, demo_dir, damages):
    run = _copy(base, tmp_path)
    root = run / "checkpoints"
    reasons = {step: damage(root / ckpt.checkpoint_name(step)) for step, damage in damages}
    resumed_at = min(reasons) - 3
    proc = T.run_train(run, demo_dir, *STEPS_EVERY)
    warnings = _stderr_lines(proc, "warning: checkpoint")
    assert len(warnings) == len(damages), proc.stderr[-3000:]
    for line, (step, _) in zip(warnings, damages):
        name = ckpt.checkpoint_name(step)
        assert line.startswith(f"warning: checkpoint {root / name} is damaged ({reasons[step]}")
        assert line.endswith(f"moved to {root / 'damaged' / name}; trying {ckpt.checkpoint_name(step - 3)}")
        assert (root / "damaged" / name).is_dir()  # kept, not deleted
    assert f"resumed from {root / ckpt.checkpoint_name(resumed_at)} at step {resumed_at}" in proc.stdout
    assert "Traceback" not in proc.stderr
    _assert_same_as_reference(run, reference, resumed_at, tmp_path)
    assert ckpt.verify(root / "iter_0000012", collective=False) is None  # the rerun's own final save


@pytest.mark.slow
def test_no_loadable_checkpoint_is_one_line_exit_2(base, tmp_path, demo_dir):
    run = _copy(base, tmp_path)
    root = run / "checkpoints"
    for _, path in ckpt.complete_checkpoints(root):
        _truncate_shard(path)
    proc = T.run_train(run, demo_dir, *STEPS_EVERY, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = _stderr_lines(proc, "megagate train: error:")
    assert errors == [
        f"megagate train: error: no loadable checkpoint in {root}: 4 damaged checkpoint(s) moved to "
        f"{root / 'damaged'} (iter_0000012, iter_0000009, iter_0000006, iter_0000003); rerun to start from scratch, "
        "or restore a good checkpoint there"
    ]
    assert len(_stderr_lines(proc, "warning: checkpoint")) == 4
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (root / "damaged").iterdir()) == [f"iter_{s:07d}" for s in (3, 6, 9, 12)]
    assert ckpt.complete_checkpoints(root) == []
    damaged = root / "damaged" / "iter_0000012"  # analysis reads it through the manifest too
    analyze = forked.run_cli(["analyze", str(damaged), "--out", str(tmp_path / "analysis")], timeout=300)
    size = (damaged / "__0_0.distcp").stat().st_size
    saved = (base / "checkpoints" / "iter_0000012" / "__0_0.distcp").stat().st_size
    assert analyze.returncode == 2 and "Traceback" not in analyze.stderr, analyze.stderr[-3000:]
    assert _stderr_lines(analyze, "megagate analyze: error:") == [
        f"megagate analyze: error: checkpoint {str(damaged)!r} is damaged: __0_0.distcp: size {size}, "
        f"manifest says {saved}"
    ]


def _craft(path: Path, name: str, marker: Path) -> None:
    if name == ".metadata":
        (path / name).write_bytes(pickle.dumps(RunsCode(marker)))
    else:  # rng_0.pt, or a legacy common.pt that megatron would load
        torch.save({"torch": torch.zeros(2), "x": RunsCode(marker)}, path / name)


@pytest.mark.slow
def test_crafted_pickle_is_refused_by_train(base, tmp_path, demo_dir):
    """A real resume meets a crafted `.metadata` (the first file torch's DCP unpickles): refused in one line."""
    run = _copy(base, tmp_path)
    newest = run / "checkpoints" / "iter_0000012"
    marker = tmp_path / "code-ran"
    _craft(newest, ".metadata", marker)
    proc = T.run_train(run, demo_dir, *STEPS_EVERY, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert _stderr_lines(proc, "megagate train: error:") == [
        f"megagate train: error: refusing to load {newest / '.metadata'}: it references posix.system, which is not data"
    ]
    assert "Traceback" not in proc.stderr and not marker.exists()
    assert newest.is_dir() and not (run / "checkpoints" / "damaged").exists()  # refused, not taken for damage


@pytest.mark.slow  # a real run with four checkpoints (the scanner tests above stay fast)
@pytest.mark.parametrize("name", [".metadata", "rng_0.pt", "common.pt"])
def test_crafted_pickle_is_refused_by_analyze(base, tmp_path, name, capsys):
    """`megagate analyze` (in this process: the refusal comes before anything is built) on each crafted file."""
    from megagate import cli

    run = _copy(base, tmp_path)
    newest = run / "checkpoints" / "iter_0000012"
    marker = tmp_path / "code-ran"
    _craft(newest, name, marker)
    assert cli.main(["analyze", str(newest), "--out", str(tmp_path / "analysis")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"megagate analyze: error: refusing to load {newest / name}: it references posix.system, which is not data"
    ]
    assert not marker.exists() and not (tmp_path / "analysis").exists()


# --- free space, on a real tmpfs in a user + mount namespace --------------------------------------------------------
def _train_on_tmpfs(run: Path, demo_dir: Path, mount_options: str, *overrides: str) -> subprocess.CompletedProcess:
    """`megagate train` with checkpoint.dir on a fresh tmpfs; its files are copied to run/ckpt-copy before the
    namespace (and the tmpfs) goes away."""
    mnt, copy = run / "mnt", run / "ckpt-copy"
    mnt.mkdir(parents=True)
    args = [
        "--config",
        str(T.CONFIG),
        *T.BASE,
        f"data.demo_dir={demo_dir}",
        f"output.dir={run}",
        f"checkpoint.dir={mnt}",
        *overrides,
    ]
    train = " ".join(f"'{a}'" for a in [sys.executable, "-m", "megagate", "train", *args])
    script = f"mount -t tmpfs -o {mount_options} none {mnt} || exit 97; {train}; rc=$?; cp -a {mnt} {copy}; exit $rc"
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script],
        cwd=T.ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.slow
def test_too_small_for_one_checkpoint_is_refused_before_writing(tmp_path, demo_dir):
    proc = _train_on_tmpfs(tmp_path, demo_dir, "size=2m", "checkpoint.interval=4", "train.train_steps=4")
    if proc.returncode == 97:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {proc.stderr[-300:]}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = _stderr_lines(proc, "megagate train: error:")
    assert line.startswith(
        f"megagate train: error: not enough free space for checkpoint {tmp_path / 'mnt'}/iter_0000004"
    )
    needed, free = [int(x.replace(",", "")) for x in re.findall(r"([\d,]+) (?:bytes|are free)", line)]
    assert free <= 2 << 20 < needed  # the estimate is above the tmpfs size
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt-copy").iterdir()) == []  # nothing written, no .tmp left


@pytest.mark.slow
@pytest.mark.parametrize(
    "options, message",
    [
        ("size=7m", "not enough free space for checkpoint"),  # refused by the estimate (the first one's size)
        ("size=64m,nr_inodes=11", "No space left on device (ENOSPC)"),  # bytes pass, the write fails midway
    ],
    ids=["estimate", "enospc-during-write"],
)
def test_room_for_one_checkpoint_only_keeps_the_first_intact(tmp_path, demo_dir, options, message):
    proc = _train_on_tmpfs(tmp_path, demo_dir, options, "checkpoint.interval=4", "train.train_steps=8")
    if proc.returncode == 97:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {proc.stderr[-300:]}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = _stderr_lines(proc, "megagate train: error:")
    assert "iter_0000008" in line and message in line, line
    assert "Traceback" not in proc.stderr
    copy = tmp_path / "ckpt-copy"
    assert sorted(p.name for p in copy.iterdir()) == ["iter_0000004"]  # no iter_0000008, no .iter_0000008.tmp
    assert ckpt.verify(copy / "iter_0000004", collective=False) is None  # every byte as saved
