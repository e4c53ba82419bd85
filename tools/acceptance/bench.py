"""Part `benchmark`: one training step of the acceptance model, {baseline, G1} x {SDPA, megatron's local attention}.

The four models are built by the trainer's model factory from the acceptance config as the trainer resolves it on
this machine (its fusions, and what is off for a missing kernel), with megatron's own initialisation on the device and
torch's fused AdamW on the bf16 parameters (no DDP or distributed optimizer: the training part has those). All
four stay resident and are timed in interleaved rounds whose order rotates, so drift in clocks or temperature hits
every case alike; each case's first steps (kernel selection, torch.compile of megatron's fusions, the allocator)
are warm-up and reported apart. Figures go to the result file after the warm-up and after every round, and the
rounds stop early where the next one would not fit the part's share: a benchmark cut short still reports.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from tools.acceptance import child

CASES = (("baseline", "baseline"), ("g1", "g1-elementwise"))
KERNELS = ("sdpa", "local")
MARGIN_S = 8.0  # left of the share for the last write and the exit


def _sig(seconds: float) -> float:
    return float(f"{seconds:.6g}")


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[1], q[2]


def _resident_gib(model, opt) -> float:
    """Parameters, gradients and optimizer state of one case (what stays allocated between its steps)."""
    import torch

    total = 0
    for p in model.parameters():
        total += p.numel() * p.element_size() * (2 if p.requires_grad else 1)  # + its gradient
        total += sum(t.numel() * t.element_size() for t in opt.state.get(p, {}).values() if torch.is_tensor(t))
    return total / 2**30


@contextlib.contextmanager
def world(cuda: bool, record: child.Record) -> Iterator[None]:
    """A one-process torch.distributed world on NCCL, as the trainer has on a GPU: megatron's loss all-reduces over
    its (one-rank) tensor-parallel group every step, which on gloo would copy CUDA tensors to the host. Where NCCL
    cannot start, gloo, said in the figures. On CPU nothing: `single_process` makes its gloo world."""
    import torch
    import torch.distributed as dist

    if not cuda:
        yield
        return
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            dist.init_process_group("nccl", init_method=f"file://{tmp}/nccl", rank=0, world_size=1)
            probe = torch.ones(1, device="cuda")
            dist.all_reduce(probe)  # NCCL makes its communicator at the first collective: fail here, not later
            torch.cuda.synchronize()
            backend = "nccl"
        except Exception as exc:  # noqa: BLE001 - reported, and the benchmark still runs
            if dist.is_initialized():
                dist.destroy_process_group()
            dist.init_process_group("gloo", init_method=f"file://{tmp}/gloo", rank=0, world_size=1)
            backend = f"gloo (nccl failed: {type(exc).__name__}: {str(exc)[:200]})"
        record.update(process_group=backend)
        try:
            yield
        finally:
            dist.destroy_process_group()


class Case:
    """One (gate, core attention) model with its optimizer, and its measurements."""

    def __init__(self, name: str, cfg, cuda: bool) -> None:
        import torch

        from megagate.model.counts import flops_per_token, parameter_counts
        from megagate.model_factory import build_model
        from megagate.run_setup import resolve

        self.name, self.cfg, self.cuda = name, cfg, cuda
        # the trainer's set-up on this machine; megatron's own initialisation on the device, not the trainer's
        # layout-independent draw of ~1B numbers on the CPU (most of the share, four times over)
        (self.model,) = build_model(resolve(cfg, 1), initialise=False)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1, fused=cuda)
        self.flops_per_token = flops_per_token(cfg.model, cfg.train.seq_length)
        self.params = parameter_counts(cfg.model)["total"]
        self.times: list[float] = []
        self.losses: list[float] = []
        self.host_syncs: list[int] = []  # synchronising CUDA calls per timed step (none counted without CUDA)
        self.last_syncs: int | None = None
        self.figures: dict[str, Any] = {"params": self.params, "ffn": cfg.model.effective_ffn_hidden_size}

    def step(self, batch) -> float:
        """One forward, backward and AdamW step; its wall time (the device synchronised at both ends). The
        synchronising CUDA calls in between are counted (torch.cuda.set_sync_debug_mode) into `last_syncs`."""
        import torch

        from megagate.train.step_values import cuda_syncs

        tokens, position_ids, labels = batch
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with cuda_syncs() as syncs:
            loss = self.model(tokens, position_ids, None, labels=labels).float().mean()
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        if self.cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        self.last_syncs = len(syncs) if self.cuda else None
        self.losses.append(float(loss.detach()))
        return elapsed

    def summary(self, tokens_per_step: int, peak_tflops: float | None) -> dict[str, Any]:
        out = dict(self.figures)
        if self.times:
            q1, median, q3 = _quartiles(self.times)
            tflops = self.flops_per_token * tokens_per_step / median / 1e12
            out.update(  # 6 significant digits: a step of a few ms keeps its precision (ratios are taken of it)
                step_s=_sig(median),
                step_s_iqr=[_sig(q1), _sig(q3)],
                times_s=[_sig(t) for t in self.times],
                tokens_per_s=round(tokens_per_step / median, 1),
                tflops=float(f"{tflops:.4g}"),
                mfu_datasheet=float(f"{tflops / peak_tflops:.4g}") if peak_tflops else None,
            )
        if self.losses:
            out.update(loss_first=self.losses[0], loss_last=self.losses[-1])
        out["host_syncs_per_step"] = statistics.median(self.host_syncs) if self.host_syncs else None
        return out


def body(args, record: child.Record) -> None:
    import torch

    from megagate import config_reader
    from megagate.distributed.parallel import single_process
    from megagate.model.counts import flops_per_token
    from megagate.plan.devices import from_cuda_name

    deadline = time.monotonic() + args.seconds - MARGIN_S
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        record.fail("CUDA is not available: the benchmark's 1.7B-shaped models are not run on the CPU")
        return
    cfgs = {
        f"{name}/{kernel}": config_reader.load(
            str(args.config),
            [*args.set, f"model.gate.preset={preset}", f"perf.core_attention={kernel}"],
            environment=False,
        )
        for name, preset in CASES
        for kernel in KERNELS
    }
    first = next(iter(cfgs.values()))
    m, t = first.model, first.train
    tokens_per_step = t.micro_batch_size * t.seq_length
    known = from_cuda_name(torch.cuda.get_device_name(0)) if cuda else None
    peak = known.peak_tflops("bf16") if known else None

    record.update(
        shape={
            "preset": (first.raw.get("model") or {}).get("preset"),
            "layers": m.num_layers,
            "hidden": m.hidden_size,
            "heads": f"{m.num_attention_heads}/{m.num_query_groups} x {m.head_dim}",
            "vocab": m.vocab_size,
            "seq": t.seq_length,
            "micro_batch": t.micro_batch_size,
            "precision": t.precision,
            # the output layer's GEMM (forward + two backward) per token, against the whole step's model FLOPs
            "head_share_of_flops": round(6 * m.vocab_size * m.hidden_size / flops_per_token(m, t.seq_length), 3),
        },
        datasheet_bf16_tflops=peak,
        optimizer="torch AdamW (fused on GPU) on the bf16 parameters; no DDP or distributed optimizer",
        host_syncs=(
            "synchronising CUDA calls per timed step, counted with torch.cuda.set_sync_debug_mode"
            if cuda
            else "not counted: no CUDA (host_syncs_per_step null)"
        ),
    )
    gen = torch.Generator().manual_seed(0)
    device = "cuda" if cuda else "cpu"
    tokens = torch.randint(0, m.vocab_size, (t.micro_batch_size, t.seq_length + 1), generator=gen).to(device)
    position_ids = torch.arange(t.seq_length, device=device).unsqueeze(0).expand(t.micro_batch_size, -1)
    batch = (tokens[:, :-1].contiguous(), position_ids, tokens[:, 1:].contiguous())

    cases: dict[str, Case] = {}
    errors: dict[str, str] = {}

    def publish(**extra: Any) -> None:
        summaries = {k: c.summary(tokens_per_step, peak) for k, c in cases.items()}
        summaries.update({k: {"error": e} for k, e in errors.items()})
        record.update(cases=summaries, ratios=ratios(cases), **extra)

    with world(cuda, record), single_process(seed=first.seed):
        for key, cfg in cfgs.items():  # build and warm up each case; one that cannot run is reported, not fatal
            try:
                case = Case(key, cfg, cuda)
                start = time.perf_counter()
                case.step(batch)
                case.figures["first_step_s"] = round(time.perf_counter() - start, 3)
                case.step(batch)
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                    resident = torch.cuda.memory_allocated()
                    case.step(batch)
                    case.figures["step_peak_gib_above_resident"] = round(
                        (torch.cuda.max_memory_allocated() - resident) / 2**30, 3
                    )
                    case.figures["resident_gib"] = round(_resident_gib(case.model, case.opt), 3)
                cases[key] = case
            except Exception as exc:  # noqa: BLE001 - an out-of-memory case must not hide the others' figures
                errors[key] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
            if key in errors:  # freed once the exception (whose traceback holds the case) is gone
                case = None
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
            publish(rounds_done=0)
        if not cases:
            record.fail(f"no case ran: {errors}")
            return
        gc.collect()
        gc.disable()  # as the trainer's manual GC: no collection inside a timed step
        order, done, round_s = list(cases), 0, 0.0
        for r in range(args.rounds):
            if time.monotonic() + round_s > deadline:
                break
            start = time.monotonic()
            for key in order[r % len(order) :] + order[: r % len(order)]:
                try:
                    cases[key].times.append(cases[key].step(batch))
                    if cases[key].last_syncs is not None:
                        cases[key].host_syncs.append(cases[key].last_syncs)
                except Exception as exc:  # noqa: BLE001 - dropped from the later rounds, the others go on
                    errors[key] = f"round {r + 1}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
            for key in [k for k in order if k in errors]:
                order.remove(key)
                del cases[key]
            if not order:
                break
            done, round_s = r + 1, time.monotonic() - start
            publish(rounds_done=done, rounds_planned=args.rounds)
            gc.collect()
        gc.enable()
        if done == 0:
            record.fail(f"no timed round fitted the part's share ({args.seconds:.0f} s) after the warm-up")
            return
        if cuda:
            record.update(max_memory_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
    bad = [k for k, c in cases.items() if not all(x == x and abs(x) != float("inf") for x in c.losses)]
    if bad or errors:
        record.fail("; ".join([*(f"{k}: non-finite loss" for k in bad), *(f"{k}: {e}" for k, e in errors.items())]))


def ratios(cases: dict[str, Case]) -> dict[str, float]:
    """G1 / baseline and SDPA / local: ratios of the median step times and paired per round (the median over
    rounds of the ratio of that round's times, robust to drift), and of the step's peak memory."""
    out: dict[str, float] = {}

    def add(label: str, a: str, b: str) -> None:
        if a not in cases or b not in cases or not cases[a].times or not cases[b].times:
            return
        ta, tb = cases[a].times, cases[b].times
        out[f"{label}_step_time"] = round(statistics.median(ta) / statistics.median(tb), 4)
        out[f"{label}_step_time_paired"] = round(statistics.median(x / y for x, y in zip(ta, tb)), 4)
        pa, pb = (cases[k].figures.get("step_peak_gib_above_resident") for k in (a, b))
        if pa and pb:
            out[f"{label}_step_peak_memory"] = round(pa / pb, 4)

    for kernel in KERNELS:
        add(f"g1_over_baseline/{kernel}", f"g1/{kernel}", f"baseline/{kernel}")
    for name, _ in CASES:
        add(f"sdpa_over_local/{name}", f"{name}/sdpa", f"{name}/local")
    return out


def options(p) -> None:
    p.add_argument("--config", required=True, help="the acceptance's YAML config")
    p.add_argument("--set", action="append", default=[], help="a config override key=value (repeatable)")
    p.add_argument("--rounds", type=int, default=8, help="timed rounds (each steps every case once)")
    p.add_argument("--seconds", type=float, required=True, help="the part's share of the budget")


if __name__ == "__main__":
    child.main(__doc__.splitlines()[0], body, options)
