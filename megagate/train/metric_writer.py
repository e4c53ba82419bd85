"""What the run reports: TensorBoard scalars, metrics.jsonl (megagate.monitor.runfiles schema), a console line.

Only the logging rank (last pipeline stage, first tensor/data-parallel rank) writes; values it logs are global
(losses averaged over data-parallel ranks, the gradient norm after the reduction).
"""

from __future__ import annotations

import math
import time

import torch

from megagate.monitor import runfiles


def mfu_peaks(cuda_name: str | None, precision: str) -> tuple[dict[str, float], str | None]:
    """The peaks (TFLOP/s, keyed by the logged metric's name: mfu_bf16, mfu_fp8, mfu_tf32) of a GPU named
    `cuda_name` (torch.cuda.get_device_name(), matched exactly) for a run in `precision`, and a one-line note when
    no MFU can be logged (no GPU, or a part the table does not know)."""
    if cuda_name is None:
        return {}, None
    from megagate.plan.devices import from_cuda_name  # the planner's device table, one source for both

    known = from_cuda_name(cuda_name)
    if known is None:
        return {}, f"MFU is not logged: GPU {cuda_name!r} is not in the device table (megagate/plan/devices.py)"
    return known.mfu_peaks(precision), None


class Metrics:
    """TensorBoard + JSONL + console progress for one run (no-ops on non-logging ranks)."""

    def __init__(
        self,
        run_dir: str,
        enabled: bool,
        tensorboard: bool,
        total_steps: int,
        tokens_per_step: int,
        flops_per_token: float,
        world_size: int,
        resumed_at: int = 0,
        precision: str = "bf16",
    ) -> None:
        self.run_dir, self.enabled = run_dir, enabled
        self.total_steps, self.tokens_per_step = total_steps, tokens_per_step
        self.flops_per_token, self.world_size = flops_per_token, world_size
        self.writer = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides what an earlier launch logged after the resumed step
            self.writer = SummaryWriter(
                log_dir=f"{run_dir}/tensorboard", purge_step=resumed_at + 1 if resumed_at else None
            )
        # mfu_<precision of the peak>: an FP8 run is measured against both its FP8 and the bf16 peak
        self.peaks, note = mfu_peaks(torch.cuda.get_device_name() if torch.cuda.is_available() else None, precision)
        if note and enabled:
            print(note, flush=True)
        self._start = time.perf_counter()
        self._first_step: int | None = None

    def train_step(
        self,
        step: int,
        loss: float,
        lr: float,
        grad_norm: float,
        step_time: float,
        extra: dict[str, float] | None = None,
    ) -> None:
        if not self.enabled:
            return
        if self._first_step is None:
            self._first_step, self._start = step, time.perf_counter() - step_time
        tokens_per_s = self.tokens_per_step / step_time if step_time > 0 else 0.0
        tflops = self.flops_per_token * tokens_per_s / self.world_size / 1e12
        values: dict[str, float] = {
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s,
            "step_time": step_time,
            "tflops_per_gpu": tflops,
        }
        for key, peak in self.peaks.items():
            values[key] = tflops / peak
        if torch.cuda.is_available():
            values["memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        values.update(extra or {})
        runfiles.write_metrics(self.run_dir, step, "train", **{k: v for k, v in values.items()})
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(f"train/{key}", value, step)
        done = step - self._first_step + 1
        elapsed = time.perf_counter() - self._start
        eta = elapsed / done * (self.total_steps - step)
        z_loss = values.get("z_loss")  # train.z_loss_coeff: the term beside the loss (which does not include it)
        print(
            f"step {step:>6d}/{self.total_steps} | loss {loss:8.4f} | "
            + ("" if z_loss is None else f"z-loss {z_loss:.3e} | ")
            + f"lr {lr:.3e} | grad {grad_norm:7.3f} | "
            f"{tokens_per_s:9.0f} tok/s | {step_time * 1000:7.1f} ms/step | ETA {_duration(eta)}",
            flush=True,
        )

    def validation(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        ppl = math.exp(min(loss, 50.0))
        runfiles.write_metrics(self.run_dir, step, "valid", loss=loss, ppl=ppl)
        if self.writer is not None:
            self.writer.add_scalar("valid/loss", loss, step)
            self.writer.add_scalar("valid/ppl", ppl, step)
        print(f"validation at step {step}: loss {loss:.4f} | perplexity {ppl:.2f}", flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
