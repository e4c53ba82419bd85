"""One-shot GPU acceptance: the GPU tests, a short bf16 training and an interleaved throughput benchmark, in one JSON.

Made for one H200 with torch but no Transformer Engine, apex, DALI or network (megatron-core comes as a carried
wheel; `tools/gpu_acceptance.sh` installs it and calls this). It runs, in this order:

1. `pytest -m gpu tests/gpu` (the GPU tests; TE-only ones skip) -> passed / failed / skipped counts;
2. `megagate train` on a 1.7B-28L-shaped model (the paper's Table 7 shape with its layers reduced to fit the time
   box) in bf16 on mock data: the loss, tokens/s, TFLOP/s, MFU and peak memory the trainer itself logs;
3. an in-process benchmark of one training step (forward, backward, AdamW) of the same shape, for
   {baseline, G1} x {SDPA, megatron's local core attention}: the cases are measured in interleaved rounds (each
   round times every case once, so drift in clocks or temperature hits all of them alike) and reported as medians,
   with G1 / baseline and SDPA / local ratios and each case's peak memory.

`--smoke` runs the same code on CPU with the tiny preset in a few seconds per part (the test suite's check of this
script); the figures it gives mean nothing. Usage:

    python tools/gpu_acceptance.py --out OUT [--smoke] [--skip-tests] [--layers 4] [--seq 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = (("baseline", "baseline"), ("g1", "g1-elementwise"))
KERNELS = ("sdpa", "local")


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def device_info() -> dict[str, Any]:
    """What ran: device, driver stack and library versions."""
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    try:
        import megatron.core

        info["megatron_core"] = megatron.core.__version__
    except Exception as exc:  # the wheel did not install: everything below fails; say why here
        info["megatron_core"] = f"missing ({exc})"
    try:
        import transformer_engine  # noqa: F401

        info["transformer_engine"] = True
    except Exception:
        info["transformer_engine"] = False
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=torch.cuda.get_device_name(0),
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
        )
    return info


# --- 1. the GPU tests --------------------------------------------------------------------------------------------
def run_gpu_tests(out: Path, timeout: int) -> dict[str, Any]:
    """pytest -m gpu on tests/gpu; counts from its JUnit XML."""
    xml = out / "gpu_tests.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "gpu",
        "tests/gpu",
        f"--junitxml={xml}",
        "-p",
        "no:cacheprovider",
    ]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-4000:]
    except subprocess.TimeoutExpired as exc:
        rc, tail = "timeout", str(exc)[-2000:]
    result: dict[str, Any] = {"rc": rc, "seconds": round(time.perf_counter() - start, 1)}
    if xml.exists():
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        total = int(suite.get("tests", 0))
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped = int(suite.get("skipped", 0))
        result.update(total=total, failed=failed, skipped=skipped, passed=total - failed - skipped)
        result["failures"] = [
            f"{case.get('classname')}::{case.get('name')}"
            for case in suite.iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None
        ]
    if rc != 0:
        result["output_tail"] = tail
    return result


# --- 2. a short training with the trainer ------------------------------------------------------------------------
def _shape_overrides(smoke: bool, layers: int, seq: int) -> list[str]:
    if smoke:
        return ["model.preset=tiny", f"model.num_layers={layers}", f"train.seq_length={seq}"]
    return [
        "model.preset=1.7b-28l",
        f"model.num_layers={layers}",
        f"model.max_sequence_length={seq}",
        f"train.seq_length={seq}",
    ]


def run_training(out: Path, smoke: bool, layers: int, seq: int, steps: int, timeout: int) -> dict[str, Any]:
    """`megagate train` (bf16 on GPU) with G1 and SDPA; the trainer's own logged figures."""
    run_dir = out / "train_run"
    cmd = [
        sys.executable,
        "-m",
        "megagate",
        "train",
        "--config",
        str(ROOT / "examples" / "tiny_cpu.yaml"),
        *_shape_overrides(smoke, layers, seq),
        "model.gate.preset=g1-elementwise",
        f"train.precision={'fp32' if smoke else 'bf16'}",
        f"train.micro_batch_size={1 if smoke else 2}",
        f"train.global_batch_size={2 if smoke else 8}",
        f"train.train_steps={steps}",
        "train.warmup_steps=2",
        "train.lr=3.0e-4",
        "train.min_lr=3.0e-5",
        "train.eval_interval=0",
        "train.eval_iters=1",
        "data.demo=false",
        "data.mock=true",
        "checkpoint.interval=0",
        "logging.interval=1",
        "logging.tensorboard=false",
        "perf.core_attention=sdpa",
        f"output.dir={run_dir}",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-4000:]
    except subprocess.TimeoutExpired as exc:
        rc, tail = "timeout", str(exc)[-2000:]
    result: dict[str, Any] = {"rc": rc, "seconds": round(time.perf_counter() - start, 1), "command": cmd[3:]}
    metrics = run_dir / "metrics.jsonl"
    rows = []
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("split") == "train"]
    if train:
        steady = train[len(train) // 2 :] or train  # the first steps compile and warm the allocator
        result.update(
            steps=len(train),
            first_loss=train[0]["loss"],
            last_loss=train[-1]["loss"],
            loss_fell=train[-1]["loss"] < train[0]["loss"],
        )
        for key in sorted({k for r in steady for k in r}):
            if key in ("tokens_per_s", "tflops_per_gpu", "step_time", "memory_gib") or key.startswith("mfu"):
                values = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
                if values:
                    result[f"median_{key}"] = statistics.median(values)
    if rc != 0:
        result["output_tail"] = tail
    return result


# --- 3. interleaved step benchmark -------------------------------------------------------------------------------
def run_bench(smoke: bool, layers: int, seq: int, rounds: int, micro_batch: int) -> dict[str, Any]:
    """Median step time, tokens/s, TFLOP/s, MFU and peak memory per (gate, core attention), interleaved."""
    import torch

    from megagate.distributed.parallel import single_process
    from megagate.model import gate as gates
    from megagate.model import init
    from megagate.model.build import build_gpt_model, transformer_config
    from megagate.model.counts import flops_per_token
    from megagate.model.presets import model_preset
    from megagate.plan.devices import from_cuda_name

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    base = dict(num_layers=layers) if smoke else dict(num_layers=layers, max_sequence_length=seq)
    preset = "tiny" if smoke else "1.7b-28l"
    known = from_cuda_name(torch.cuda.get_device_name()) if cuda else None
    peak_tflops = known.peak_tflops("bf16") if known else None
    results: dict[str, Any] = {"shape": preset, "layers": layers, "seq": seq, "micro_batch": micro_batch}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    with single_process():
        models: dict[str, Any] = {}
        for name, gate_preset in CASES:
            mc = model_preset(preset, gate=gates.preset(gate_preset), **base)
            for kernel in KERNELS:
                cfg = transformer_config(mc, params_dtype=dtype)
                model = build_gpt_model(mc, cfg, core_attention=kernel)
                init.initialize([model], 1234, mc.init_method_std, mc.num_layers)
                if cuda:
                    model.cuda()
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
                models[f"{name}/{kernel}"] = (mc, model, opt)
        device = "cuda" if cuda else "cpu"
        vocab = next(iter(models.values()))[0].vocab_size
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (micro_batch, seq + 1), generator=gen).to(device)
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(micro_batch, -1)

        def step(model: Any, opt: Any) -> float:
            sync()
            start = time.perf_counter()
            loss = model(inputs, position_ids, None, labels=labels).float().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            return time.perf_counter() - start

        peaks: dict[str, float] = {}
        for key, (_, model, opt) in models.items():  # warm-up (kernel selection, allocator) + peak memory
            step(model, opt)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                resident = torch.cuda.memory_allocated()
                step(model, opt)
                peaks[key] = (torch.cuda.max_memory_allocated() - resident) / 2**30
        times: dict[str, list[float]] = {key: [] for key in models}
        for _ in range(rounds):
            for key, (_, model, opt) in models.items():
                times[key].append(step(model, opt))
        cases: dict[str, Any] = {}
        for key, (mc, _, _) in models.items():
            t = statistics.median(times[key])
            tokens_per_s = micro_batch * seq / t
            tflops = flops_per_token(mc, seq) * tokens_per_s / 1e12
            cases[key] = {
                "step_s": round(t, 5),
                "tokens_per_s": round(tokens_per_s, 1),
                "tflops": float(f"{tflops:.4g}"),
                "mfu_bf16": float(f"{tflops / peak_tflops:.4g}") if peak_tflops else None,
                "step_peak_gib_above_resident": round(peaks[key], 3) if key in peaks else None,
                "times_s": [round(x, 5) for x in times[key]],
            }
        results["cases"] = cases
        results["ratios"] = {
            f"g1_over_baseline_step_time/{k}": round(cases[f"g1/{k}"]["step_s"] / cases[f"baseline/{k}"]["step_s"], 4)
            for k in KERNELS
        }
        for name, _ in CASES:
            results["ratios"][f"sdpa_over_local_step_time/{name}"] = round(
                cases[f"{name}/sdpa"]["step_s"] / cases[f"{name}/local"]["step_s"], 4
            )
            if f"{name}/sdpa" in peaks:
                results["ratios"][f"sdpa_over_local_step_peak_memory/{name}"] = round(
                    peaks[f"{name}/sdpa"] / peaks[f"{name}/local"], 4
                )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_acceptance.json and the logs")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script, not the GPU")
    parser.add_argument("--skip-tests", action="store_true", help="skip pytest -m gpu")
    parser.add_argument("--layers", type=int, default=None, help="layers of the 1.7B-28L shape (default 4)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 4096)")
    parser.add_argument("--steps", type=int, default=None, help="trainer steps (default 30)")
    parser.add_argument("--rounds", type=int, default=None, help="benchmark rounds (default 8)")
    args = parser.parse_args(argv)
    smoke = args.smoke

    def given(value: int | None, default: int) -> int:
        return default if value is None else value

    layers = given(args.layers, 2 if smoke else 4)
    seq = given(args.seq, 64 if smoke else 4096)
    steps = given(args.steps, 4 if smoke else 30)
    rounds = given(args.rounds, 2 if smoke else 8)
    for name, value in (("--layers", layers), ("--seq", seq), ("--steps", steps), ("--rounds", rounds)):
        if value < 1:
            print(f"gpu_acceptance: error: {name} {value}: must be >= 1", file=sys.stderr)
            return 2
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"gpu_acceptance: error: --out {str(args.out)!r}: {exc.strerror}", file=sys.stderr)
        return 2
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    path = args.out / "gpu_acceptance.json"
    result: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "smoke": smoke}
    result["environment"] = device_info()
    _write_json(path, result)  # a partial file with what ran, should a later part hang
    if not (smoke or args.skip_tests):
        result["gpu_tests"] = run_gpu_tests(args.out, timeout=240)
        _write_json(path, result)
    result["training"] = run_training(args.out, smoke, layers, seq, steps, timeout=180)
    _write_json(path, result)
    try:
        result["benchmark"] = run_bench(smoke, layers, seq, rounds, micro_batch=1 if smoke else 2)
    except Exception as exc:  # report what broke with the figures that were taken
        result["benchmark"] = {"error": f"{type(exc).__name__}: {exc}"}
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    _write_json(path, result)
    print(json.dumps(result, indent=2, sort_keys=True))
    failed = [
        part
        for part, ok in (
            ("gpu_tests", result.get("gpu_tests", {}).get("rc", 0) == 0),
            ("training", result["training"].get("rc") == 0),
            ("benchmark", "error" not in result["benchmark"]),
        )
        if not ok
    ]
    if failed:
        print(f"gpu_acceptance: failed parts: {', '.join(failed)} (details in {path})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
