"""tools/gpu_acceptance: its plumbing proven on CPU (--smoke: every part at toy size) and its ways to fail.

One smoke run is shared by the read-only checks (every part has a status, the result folder's contract, the last
stdout line). Then the failures the real machine may meet, each of which must still give a complete JSON that
names the failure, and leave no process behind: no megatron-core and no wheel (through the shell wrapper), a wheel
that does not install, a part that hangs past its share, a training whose loss turns NaN.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.acceptance import parts as P  # noqa: E402
from tools.acceptance import report, runner  # noqa: E402

MARK = "MEGAGATE_ACCEPTANCE_TEST"  # every process a run starts inherits it: found if left behind


@dataclass
class Run:
    proc: subprocess.CompletedProcess
    out: Path
    work: Path
    doc: dict
    summary: dict
    leftovers: list[int]

    def part(self, name: str) -> dict:
        return self.doc["parts"][name]


def _alive_with(marker: str) -> list[int]:
    needle = f"{MARK}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = open(f"/proc/{entry}/environ", "rb").read()
            state = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environ.split(b"\0") and state not in ("Z", "X"):
            found.append(int(entry))
    return found


def acceptance(tmp: Path, *args: str, env: dict | None = None, shell: bool = False, smoke: bool = True) -> Run:
    """Run the acceptance in smoke mode (through tools/gpu_acceptance.sh when `shell`); its JSON, summary line
    and the processes it left."""
    out, work, marker = tmp / "out", tmp / "work", uuid.uuid4().hex
    env = {**os.environ, "OMP_NUM_THREADS": "1", MARK: marker, **(env or {})}
    # generous caps and budget: this checks the plumbing, on a shared CI machine whose load varies (a test's own
    # --cap and --budget come later and win)
    caps = [x for name in P.NAMES for x in ("--cap", f"{name}=600")]
    options = ["--work", str(work), *(["--smoke"] if smoke else []), "--budget", "1800", *caps, *args]
    if shell:
        cmd = ["bash", "tools/gpu_acceptance.sh", str(out), *options]
        env.update(PYTHON=sys.executable, GPU_ACCEPTANCE_HARD_LIMIT="2300")  # the wrapper's backstop
    else:
        cmd = [sys.executable, "tools/gpu_acceptance.py", "--out", str(out), *options]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400)
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    summary = json.loads(lines[-1])
    doc = json.loads((out / report.JSON_NAME).read_text())
    return Run(proc, out, work, doc, summary, _alive_with(marker))


def assert_complete(run: Run) -> None:
    """Every part has a final status, the summary line agrees with the JSON, nothing was left running."""
    assert list(run.doc["parts"]) == list(P.NAMES)
    for name, part in run.doc["parts"].items():
        assert part["status"] in runner.STATUSES, (name, part)
        if part["status"] != "ok":
            assert part.get("reason") or part.get("error_tail"), (name, part)
    assert run.doc["finished"] and run.summary["parts"] == {n: p["status"] for n, p in run.doc["parts"].items()}
    assert run.summary["gpu_acceptance"] == run.doc["result"]
    assert len(run.proc.stdout.strip().splitlines()[-1].encode()) <= report.SUMMARY_CAP
    assert run.leftovers == []


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Run:
    return acceptance(tmp_path_factory.mktemp("smoke"))


# --- the smoke run ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smoke_runs_every_part(smoke):
    assert smoke.proc.returncode == 0, smoke.proc.stdout[-3000:] + smoke.proc.stderr[-3000:]
    assert_complete(smoke)
    statuses = {n: p["status"] for n, p in smoke.doc["parts"].items()}
    assert all(s == "ok" for n, s in statuses.items() if n != "calibrate"), statuses
    assert smoke.doc["result"] == "ok" and smoke.doc["mode"] == "smoke"
    assert smoke.part("install")["figures"]["megatron_core"].startswith("0.19")
    pre = smoke.part("preflight")["figures"]
    assert pre["cuda_available"] is False and pre["matmul"]["tflops_median"] > 0 and pre["sdpa"]["math"]["runs"]
    bench = smoke.part("benchmark")["figures"]
    cases = bench["cases"]
    assert set(cases) == {"baseline/sdpa", "baseline/local", "g1/sdpa", "g1/local"}
    for case in cases.values():
        assert len(case["times_s"]) == 2 and case["step_s"] > 0 and case["tflops"] > 0
    ratio = bench["ratios"]["g1_over_baseline/sdpa_step_time"]
    assert ratio == pytest.approx(cases["g1/sdpa"]["step_s"] / cases["baseline/sdpa"]["step_s"], rel=1e-3)
    assert bench["shape"]["layers"] == 2 and 0 < bench["shape"]["head_share_of_flops"] < 1
    train = smoke.part("training")["figures"]
    assert train["steps"] == 4 and train["median_tokens_per_s"] > 0 and train["first_loss"] > 0
    plan = smoke.part("plan")["figures"]
    assert plan["fits"] is True and plan["peak_gb"] > 0
    tests = smoke.part("gpu_tests")["figures"]
    assert tests["passed"] == tests["failed"] == 0 and tests["skipped"] > 10  # no CUDA: every GPU test skips


@pytest.mark.slow
def test_smoke_result_folder_contract(smoke):
    files = sorted(smoke.out.iterdir())
    assert 1 <= len(files) <= 8 and all(f.is_file() for f in files)
    assert {f.name for f in files} <= set(report.RESULT_FILES)
    assert {"gpu_acceptance.json", "gpu_acceptance.log", "training_metrics.jsonl", "gpu_tests.txt"} <= {
        f.name for f in files
    }
    assert all(f.stat().st_size <= 1_000_000 for f in files)
    assert smoke.doc["files"] == sorted(f.name for f in files)
    # the training's run folder, data cache and (no) checkpoint stay in the work folder
    run_dir = smoke.work / "train_run"
    assert (run_dir / "metrics.jsonl").exists() and (run_dir / "data_cache").is_dir()
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    rows = [json.loads(line) for line in (smoke.out / "training_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2, 3, 4]


@pytest.mark.slow
def test_smoke_last_stdout_line_is_the_summary(smoke):
    summary = smoke.summary
    assert summary["mode"] == "smoke" and summary["json"] == str(smoke.out / report.JSON_NAME)
    assert set(summary["bench"]) == set(smoke.part("benchmark")["figures"]["cases"])
    assert summary["train"]["steps"] == 4 and "errors" not in summary


# --- failures -----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_no_megatron_and_no_wheel_still_writes_the_json(tmp_path):
    """A machine without megatron-core (a stand-in package that fails to import, first on the path) whose wheel was
    not carried: through the shell wrapper, the JSON says why and what to do; the parts needing it are skipped."""
    shim = tmp_path / "no-megatron" / "megatron" / "core"  # megatron is a namespace package: its first core wins
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('megatron-core is not installed on this machine')\n")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    env = {"PYTHONPATH": str(shim.parent.parent)}
    run = acceptance(tmp_path, "--wheels", str(wheels), "--only", "install,preflight,benchmark", env=env, shell=True)
    assert run.proc.returncode == 1
    assert_complete(run)
    install = run.part("install")
    assert install["status"] == "failed"
    assert f"no wheel in {wheels}" in install["reason"] and "make gpu-wheels" in install["reason"]
    preflight = run.part("preflight")  # runs anyway: it reports the machine
    assert preflight["status"] == "failed" and "megatron-core does not import" in preflight["reason"]
    assert preflight["figures"]["torch"] and preflight["figures"]["matmul"]["tflops_median"] > 0
    assert run.part("benchmark")["status"] == "skipped"
    assert run.part("benchmark")["reason"] == "needs install, which failed" and run.part("benchmark")["blocked"]
    assert run.summary["errors"]["install"].startswith("no wheel in")


@pytest.mark.slow
def test_gpu_mode_without_cuda_stops_at_the_preflight(tmp_path):
    """The real mode on a machine without CUDA: the preflight says so, and the 1.7B-shaped parts are not run on
    the CPU; the plan (pure arithmetic) still runs, for the acceptance's own config."""
    only = "install,preflight,benchmark,plan"
    run = acceptance(tmp_path, "--only", only, env={"CUDA_VISIBLE_DEVICES": ""}, smoke=False)
    assert run.proc.returncode == 1
    assert_complete(run)
    preflight = run.part("preflight")
    assert preflight["status"] == "failed" and preflight["reason"].startswith("CUDA is not available (torch ")
    model = {"preset": "1.7b-28l", "layers": 16, "hidden": 2048, "ffn": 5440, "vocab": 151936, "heads": 16}
    model |= {"groups": 8, "head_dim": 128, "seq": 4096, "micro_batch": 2}
    assert preflight["figures"]["shape"] == model
    assert run.doc["model"] == {**model, "used_by": ["benchmark", "training", "plan"]}
    assert run.part("benchmark")["status"] == "skipped" and run.part("benchmark")["blocked"]
    plan = run.part("plan")["figures"]
    assert plan["fits"] is True and plan["kernels"] == "gpu-sdpa" and plan["step_s"] > 0
    assert run.summary["mode"] == "gpu" and run.summary["errors"]["preflight"].startswith("CUDA is not available")


@pytest.mark.slow
def test_a_wheel_that_does_not_install_is_named(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "megatron_core-0.19.2-py3-none-any.whl").write_bytes(b"not a zip file")
    run = acceptance(tmp_path, "--wheels", str(wheels), "--only", "install,plan")
    assert run.proc.returncode == 1
    assert_complete(run)
    assert run.part("install")["status"] == "failed"
    assert run.part("install")["reason"].startswith("pip install of megatron_core-0.19.2-py3-none-any.whl failed")
    assert run.part("plan")["status"] == "skipped" and run.part("plan")["reason"] == "needs install, which failed"


@pytest.mark.slow
def test_a_part_that_hangs_is_killed_with_its_children_at_its_share(tmp_path):
    """The benchmark hangs (ignoring SIGTERM, with a child process): at its 6 s share its whole process group is
    killed, the JSON says timed out, and the next part runs on what is left of the one deadline."""
    budget = 120
    args = ["--only", "benchmark,plan", "--inject-hang", "benchmark", "--cap", "benchmark=6", "--budget", str(budget)]
    run = acceptance(tmp_path, *args)
    assert run.proc.returncode == 1
    assert_complete(run)  # no process left: neither the hung part nor its child
    bench = run.part("benchmark")
    assert bench["status"] == "timed_out" and bench["given_s"] == 6
    assert bench["reason"].startswith("timed out after") and 6 <= bench["seconds"] < 6 + 10 + 5  # + SIGKILL's grace
    assert "hanging on purpose" in " ".join(bench["error_tail"])
    plan = run.part("plan")
    assert plan["status"] == "ok"
    # its share is what the deadline leaves (budget - time spent - margin), not its own cap
    assert plan["given_s"] <= budget - bench["seconds"] - 5 + 1 and plan["given_s"] < plan["cap_s"]
    assert run.summary["errors"]["benchmark"].startswith("timed out after")


@pytest.mark.slow
def test_nan_loss_is_a_failed_training_not_a_crash(tmp_path):
    fault = "monitor.faults=[{step: 2, kind: nan_grad}]"
    run = acceptance(tmp_path, "--only", "training", "--train-set", fault)
    assert run.proc.returncode == 1
    assert_complete(run)
    train = run.part("training")
    assert train["status"] == "failed" and train["rc"] == 0  # the trainer itself ran to the end
    assert train["reason"] == "the loss is not finite from step 3 (logged 'nan')"
    assert train["figures"]["steps"] == 4 and train["figures"]["first_nonfinite_grad_norm_step"] == 2
    assert run.summary["errors"]["training"].startswith("the loss is not finite")
    assert (run.out / "training_metrics.jsonl").exists()


# --- cheap checks -------------------------------------------------------------------------------------------------
def test_a_part_that_escapes_its_group_is_still_killed(tmp_path):
    """A child that starts a session of its own is out of reach of the group kill: the marker finds it."""
    code = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); "
        "time.sleep(600)"
    )
    marker = uuid.uuid4().hex
    outcome = runner.run_part(
        [sys.executable, "-c", code],
        seconds=3,
        log=tmp_path / "log",
        result=tmp_path / "result.json",
        marker=marker,
        env=dict(os.environ),
        cwd=tmp_path,
        grace=1,
    )
    assert outcome.status == "timed_out" and 3 <= outcome.seconds < 20
    assert outcome.killed_leftovers == 1 and runner.marked_processes(marker) == []


def test_summary_line_stays_under_2kb():
    doc = {
        "result": "failed",
        "mode": "gpu",
        "parts": {
            name: {"status": "failed", "reason": "x" * 5000, "figures": {"cases": {f"c{i}": {} for i in range(50)}}}
            for name in P.NAMES
        },
    }
    doc["parts"]["benchmark"]["figures"] = {
        "cases": {f"case{i}": {"tokens_per_s": 1.0 * i, "tflops": 2.0} for i in range(200)},
        "ratios": {f"r{i}": 1.0 for i in range(200)},
    }
    line = report.summary_line(doc)
    assert len(line.encode()) <= report.SUMMARY_CAP
    assert json.loads(line)["parts"] == {name: "failed" for name in P.NAMES}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budget", "0"], "--budget 0: must be a number of seconds in (0, 86400)"),
        (["--cap", "bench=10"], "--cap 'bench=10': must be PART=SECONDS with PART one of " + ", ".join(P.NAMES)),
        (["--only", "tests"], "unknown part 'tests': the parts are " + ", ".join(P.NAMES)),
        (["--set", "train.lr"], "--set/--train-set 'train.lr': must be key.path=value"),
    ],
)
def test_bad_arguments_are_one_line(tmp_path, args, message):
    proc = subprocess.run(
        [sys.executable, "tools/gpu_acceptance.py", "--out", str(tmp_path / "out"), "--smoke", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"gpu_acceptance: error: {message}"
    assert not (tmp_path / "out").exists()


# --- make gpu-wheels ----------------------------------------------------------------------------------------------
def _wheel(folder: Path, version: str) -> Path:
    """A minimal valid wheel of megatron-core `version` (what pip download checks: name, version, tags)."""
    import zipfile

    path = folder / f"megatron_core-{version}-py3-none-any.whl"
    info = f"megatron_core-{version}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: megatron-core\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_gpu_wheels_fetches_the_pinned_wheels_into_a_fresh_folder(tmp_path):
    """`make gpu-wheels` (tools/gpu_wheels.sh) from a local package index: the pinned version only, twice over an
    old .whl/ holding another version, the list and the total printed; a failed download leaves .whl/ as it was."""
    tree = tmp_path / "tree"
    (tree / "tools").mkdir(parents=True)
    (tree / "tools" / "gpu_wheels.sh").write_text((ROOT / "tools" / "gpu_wheels.sh").read_text())
    pin = next(
        line.split()[0]
        for line in (ROOT / "requirements.txt").read_text().splitlines()
        if line.startswith("megatron-core==")
    )
    version = pin.split("==")[1]
    (tree / "requirements.txt").write_text(f"torch==2.9.1\n{pin}  # comment\n")
    links = tmp_path / "links"
    links.mkdir()
    _wheel(links, version)
    _wheel(links, "0.18.0")
    (tree / ".whl").mkdir()
    _wheel(tree / ".whl", "0.18.0")  # left from an older pin: two versions would stop the install
    env = {
        **os.environ,
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(links),
        "PYTHON": sys.executable,
    }
    for _ in range(2):
        proc = subprocess.run(
            ["bash", "tools/gpu_wheels.sh"], cwd=tree, env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr
        assert sorted(p.name for p in (tree / ".whl").iterdir()) == [f"megatron_core-{version}-py3-none-any.whl"]
        lines = proc.stdout.strip().splitlines()
        assert lines[0].startswith(f"megatron_core-{version}-py3-none-any.whl  0.0 MiB")
        assert lines[-1].startswith("total 0.0 MiB in .whl/")
    (tree / "requirements.txt").write_text("megatron-core==9.9.9\n")  # not in the index
    proc = subprocess.run(
        ["bash", "tools/gpu_wheels.sh"], cwd=tree, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    assert sorted(p.name for p in (tree / ".whl").iterdir()) == [f"megatron_core-{version}-py3-none-any.whl"]
    assert [p.name for p in tree.iterdir() if p.name.startswith(".whl.new")] == []
