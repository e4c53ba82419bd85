"""The step at hand-loop speed: one gradient norm per step, host reads only where a value is needed, the next
step's data read ahead, megatron's cross-entropy without one-rank collectives, the stop check one step late.

Unit tests run in this process on real megatron objects (megatron_world); the per-step read counts and the stop
latency come from real `Trainer` runs in spawned processes (helpers.step_reads).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from helpers import distributed, step_reads


# --- cross-entropy at TP = 1 ---------------------------------------------------------------------------------------
def test_local_cross_entropy_equals_megatrons_vocab_parallel_one(megatron_world):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megagate.model.loss import local_cross_entropy

    gen = torch.Generator().manual_seed(3)
    s, b, v = 16, 3, 97
    logits = (torch.randn(s, b, v, generator=gen) * 4).requires_grad_()
    labels = torch.randint(0, v, (b, s), generator=gen)
    upstream = torch.rand(b, s, generator=gen)  # a loss mask-like weighting of the per-token losses

    ours = local_cross_entropy(labels, logits)
    (grad_ours,) = torch.autograd.grad((ours * upstream).sum(), logits)
    logits_ref = logits.detach().clone().requires_grad_()
    theirs = vocab_parallel_cross_entropy(logits_ref.clone(), labels.t().contiguous()).t()  # [s b] -> [b s]
    (grad_theirs,) = torch.autograd.grad((theirs * upstream).sum(), logits_ref)

    assert ours.shape == (b, s)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-6)
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=1e-6, atol=1e-7)  # a few ulps: another summation
    assert ours.mean().item() > 3.0  # random logits x 4: a real loss, not a degenerate one


def test_the_model_gets_the_local_loss_at_tp1(megatron_world):
    from helpers import tiny_model
    from megagate.model.loss import local_cross_entropy

    model = tiny_model.build()
    assert model.compute_language_model_loss is local_cross_entropy
    tokens = tiny_model.text_tokens(2, 32)
    positions = torch.arange(32).expand(2, 32)
    labels = torch.roll(tokens, -1, dims=1)
    per_token = model(tokens, positions, None, labels=labels)
    assert per_token.shape == (2, 32) and 4.0 < per_token.mean().item() < 8.0  # ~ln(512) at initialisation


def test_local_loss_is_not_installed_with_cross_entropy_fusion(megatron_world):
    from helpers import tiny_model
    from megagate.model.loss import use_local_cross_entropy

    model = tiny_model.build()
    del model.compute_language_model_loss  # megatron's method again
    model.config.cross_entropy_loss_fusion = True
    assert use_local_cross_entropy(model) is False
    assert "compute_language_model_loss" not in vars(model)


# --- the step log: values on the device, one read ---------------------------------------------------------------
def test_step_log_reads_every_pending_step_at_once(megatron_world):
    from megagate.train.step_values import HostReads, StepLog, StepValues

    reads = HostReads()
    log = StepLog(reads)
    seen: list = []
    log.subscribe(lambda read: seen.extend(read))
    for step, (loss, norm) in enumerate([(2.5, 1.0), (2.25, torch.tensor([0.5])), (2.0, 0.25)], start=1):
        log.add(step, torch.tensor(loss, dtype=torch.float64), norm)
    values = StepValues(log, 2)
    values.scale_seen_loss(10.0)  # a fault: the callbacks after it see 22.5, the logged loss stays 2.25
    assert reads.count == 0 and log.pending == [1, 2, 3]
    assert (values.loss, values.grad_norm, values.seen_loss) == (2.25, 0.5, 22.5)
    assert reads.count == 1 and log.pending == []  # one read for the three steps
    assert [(s, v.loss, v.grad_norm) for s, v in seen] == [(1, 2.5, 1.0), (2, 2.25, 0.5), (3, 2.0, 0.25)]
    assert log.values(3).loss == 2.0 and log.last()[0] == 3 and reads.count == 1
    log.add(4, torch.tensor(1.5, dtype=torch.float64), 0.125)
    log.drop_after(3)  # a restored checkpoint of step 3: step 4 never happened
    assert log.pending == [] and log.last()[0] == 3 and reads.count == 1
    assert log.first[0] == 1 and log.first[1].loss == 2.5


# --- prefetch: the same batches, read ahead -------------------------------------------------------------------------
class _Counting:
    """A loader factory over integers (sample i is the batch {"x": tensor(i)}); counts what it produced."""

    def __init__(self, delay: float = 0.0) -> None:
        self.produced: list[int] = []
        self.opened: list[int] = []
        self.threads: set[str] = set()
        self.delay = delay

    def __call__(self, position: int):
        self.opened.append(position)

        def gen():
            i = position
            while True:
                time.sleep(self.delay)
                self.produced.append(i)
                self.threads.add(threading.current_thread().name)
                yield {"x": torch.tensor(i)}
                i += 1

        return gen()


def test_prefetcher_gives_the_synchronous_order_and_reads_ahead():
    from megagate.data.prefetch import StepPrefetcher

    loader = _Counting(delay=0.01)
    prefetch = StepPrefetcher(loader, count=2, step_samples=2, pin=False)
    try:
        got = [prefetch.take(p, prefetch_next=True) for p in (0, 2, 4)]
        assert [[int(b["x"]) for b in step] for step in got] == [[0, 1], [2, 3], [4, 5]]
        prefetch.settle()
        assert loader.produced == [0, 1, 2, 3, 4, 5, 6, 7]  # step 4's batches were read while "step 3 ran"
        assert any(name.startswith("megagate-prefetch") for name in loader.threads)
        # a seek: the batches read ahead (8, 9) are dropped, the loader reopens at the new position
        assert [int(b["x"]) for b in prefetch.take(20, prefetch_next=False)] == [20, 21]
        assert loader.opened == [0, 20]
        # a reset (restore) forgets the loader: the next take opens it again at the position asked for
        prefetch.reset()
        assert [int(b["x"]) for b in prefetch.take(22, prefetch_next=False)] == [22, 23]
        assert loader.opened == [0, 20, 22]
    finally:
        prefetch.close()


def test_prefetcher_raises_a_loader_error_where_the_step_needs_the_data():
    from megagate.data.prefetch import StepPrefetcher
    from megagate.errors import MegagateError

    def short(position: int):
        return iter([{"x": torch.tensor(i)} for i in range(position, 3)])

    prefetch = StepPrefetcher(short, count=2, step_samples=2, pin=False)
    try:
        assert len(prefetch.take(0, prefetch_next=True)) == 2  # reading ahead hits the end of the data
        with pytest.raises(MegagateError, match="training data ended within the step starting at sample 2"):
            prefetch.take(2, prefetch_next=False)
        assert [int(b["x"]) for b in prefetch.take(0, prefetch_next=False)] == [0, 1]  # reopened after the error
    finally:
        prefetch.close()


# --- the optimizer step: one norm, the same update ------------------------------------------------------------------
def _trainer(out: Path):
    """A Trainer without callbacks on the tiny fp32 model (DDP, DistributedOptimizer) and no data (steps are given
    their micro-batches), built the way build_components builds a run's parts."""
    from megagate import config_reader
    from megagate.model_factory import build_model
    from megagate.run_setup import resolve
    from megagate.train import components as parts
    from megagate.train.trainer import Trainer

    cfg = config_reader.load(str(step_reads.CONFIG), [*step_reads.BASE, "data.mock=true", f"output.dir={out}"])
    setup = resolve(cfg, 1)
    chunks = build_model(setup)
    ddp = parts.wrap_ddp(setup, chunks)
    optimizer, scheduler = parts.build_optimizer(setup, ddp)
    from megatron.core.distributed import finalize_model_grads

    tconfig = chunks[0].config
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.grad_scale_func = None  # fp32: no loss scaler (build_components leaves it out the same way)
    tconfig.no_sync_func = ddp[0].no_sync
    return Trainer(parts.Components(setup, chunks, ddp, optimizer, scheduler, None, None, None), [])


def _batches(n: int, step: int) -> list[dict]:
    from helpers import tiny_model

    out = []
    for i in range(n):
        tokens = tiny_model.text_tokens(4, 65, index=100 * step + i)
        out.append(
            {
                "tokens": tokens[:, :-1].contiguous(),
                "labels": tokens[:, 1:].contiguous(),
                "loss_mask": torch.ones(4, 64),
                "position_ids": torch.arange(64).expand(4, 64).contiguous(),
            }
        )
    return out


def test_one_gradient_norm_per_step_and_megatrons_update(megatron_world, tmp_path):
    """The trainer's step computes the norm once (one vector norm per gradient) and updates the weights exactly as
    megatron's optimizer.step() (which computes it again) does; at DP = 1 no parameter all-gather runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megagate.train.step_values import StepValues

    calls: dict[str, int] = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            calls[name] = calls.get(name, 0) + 1
            if name == "copy_" and args[0].data_ptr() == args[1].data_ptr():
                calls["copy onto itself"] = calls.get("copy onto itself", 0) + 1
            return func(*args, **(kwargs or {}))

    from megagate.train.optim_step import skip_self_copies

    ours, theirs = _trainer(tmp_path / "ours"), _trainer(tmp_path / "theirs")
    assert all(p._defer_param_sync for p in ours.optimizer.chained_optimizers)  # the one-rank gather is off
    assert skip_self_copies(ours.optimizer) == 1  # fp32: every main shard is its parameter's own memory
    for part in theirs.optimizer.chained_optimizers:  # megatron's step, with its copies and its gather
        del part._copy_main_params_to_model_params
        part._defer_param_sync = False
    grads = len([p for chunk in ours.model for p in chunk.parameters() if p.requires_grad])
    for step in (1, 2):
        batches = _batches(2, step)
        with Count():
            output = ours.train_step(batches)
        # megatron's multi-tensor norm without Transformer Engine: one norm per gradient and one over those norms
        assert calls.get("linalg_vector_norm") == grads + 1, (calls.get("linalg_vector_norm"), grads)
        assert "allgather_into_tensor_coalesced_" not in calls and "_allgather_base_" not in calls
        assert "copy onto itself" not in calls  # megatron's step copies every float32 shard onto itself
        calls.clear()
        # megatron's own sequence: prepare, norm (for the callbacks), then step() (prepare, norm, clip, update)
        for chunk in theirs.ddp:
            chunk.zero_grad_buffer()
        theirs.optimizer.zero_grad()
        local = theirs.forward_backward(batches, forward_only=False)
        theirs.scheduler.step(increment=0)
        theirs.optimizer.prepare_grads()
        norm = theirs.optimizer.get_grad_norm()
        with Count():
            applied, _, _ = theirs.optimizer.step()
        assert calls.pop("copy onto itself") == grads and calls.pop("linalg_vector_norm") == grads + 1
        calls.clear()
        theirs.scheduler.step(increment=theirs.cfg.train.global_batch_size)
        theirs.step += 1
        assert applied and output.applied
        assert output.grad_norm == float(norm) and output.loss == float(local)
        assert isinstance(output.values, StepValues)
    for (name, a), b in zip(ours.model[0].named_parameters(), theirs.model[0].parameters()):
        assert torch.equal(a, b), name
    assert ours.reads.count == 2  # the two reads of this test (output.loss), none by the steps themselves


# --- per-step host reads and the stop latency, through real runs ---------------------------------------------------
RUNS = {
    "off": ["monitor.spike.enabled=false"],
    "warn": [],  # the default monitor: spike detection, action warn
    "skip": ["monitor.spike.action=skip"],
    "quiet": ["monitor.spike.enabled=false", "logging.interval=100"],
    "signal": ["signal_at=3,0"],  # SIGUSR1 at the end of step 3
}


@pytest.fixture(scope="module")
def counted(tmp_path_factory, session_demo_dir) -> dict:
    tmp = tmp_path_factory.mktemp("step-reads")
    return distributed.run(step_reads.worker, 1, tmp, RUNS, str(tmp / "runs"), str(session_demo_dir))[0]


@pytest.mark.slow
def test_host_reads_per_step(counted):
    """0 per step with the monitor off but at logging steps (4, 8 and the last), the same with the warn-only
    monitor (it judges each step when the logging step reads them), 1 per step with a deciding action (skip)."""
    logging_steps = {4: 1, 8: 1, 10: 1}
    expected = [(s, logging_steps.get(s, 0)) for s in range(1, 11)]
    assert counted["off"]["reads"] == expected
    assert counted["warn"]["reads"] == expected
    assert counted["skip"]["reads"] == [(s, 1) for s in range(1, 11)]
    assert counted["quiet"]["reads"] == [(s, 0) for s in range(1, 10)] + [(10, 1)]
    # the warn-only monitor judged every step, late: its history holds the 10 losses and grad norms
    history = counted["warn"]["monitor"]["history"]
    assert len(history["loss"]) == len(history["grad_norm"]) == 10
    # reading when needed changes nothing in the training: the same final loss, bit for bit
    finals = {name: counted[name]["summary"]["final_loss"] for name in ("off", "warn", "skip", "quiet")}
    assert len(set(finals.values())) == 1 and 6.0 < finals["off"] < 8.5, finals


@pytest.mark.slow
def test_stop_signal_in_one_process_stops_at_the_next_check(counted):
    run = counted["signal"]
    assert run["stopped_after"] == 3 and run["summary"]["steps"] == 3 and run["summary"]["stopped"] == "signal"


@pytest.mark.slow
@pytest.mark.distributed
def test_stop_signal_to_one_of_two_ranks_stops_both_one_step_later(tmp_path: Path, session_demo_dir):
    """SIGUSR1 to rank 1 at the end of step 3 (DP = 2): the flags' all-reduce started at step 4's check is read at
    step 5's, so both ranks stop after step 4 (one step later than a single process), with the same checkpoint."""
    runs = {"signal": ["signal_at=3,1"]}
    result = distributed.run(step_reads.worker, 2, tmp_path, runs, str(tmp_path / "runs"), str(session_demo_dir))
    for rank in (0, 1):
        run = result[rank]["signal"]
        assert run["stopped_after"] == 4, (rank, run["stopped_after"])
        assert run["summary"]["steps"] == 4 and run["summary"]["stopped"] == "signal"
    assert (tmp_path / "runs" / "signal" / "checkpoints" / "iter_0000004").is_dir()
    latency = result[1]["signal"]["latency"]
    assert latency is not None and latency > 0
    print(f"stop latency (signal at the end of step 3 on rank 1 -> decision before step 5): {latency * 1e3:.0f} ms")
