"""What a resume must keep, and what it may change: the checks between a checkpoint and the config resuming from it.

A checkpoint stores (megagate.json, written by `Trainer.save_checkpoint`) the model's `architecture`, the `data`
order it was trained on and its `schedule`. On resume:

- the architecture (shapes, gate variant, vocabulary, norms, experts) must be the same: a one-line error lists what
  differs (a different model cannot load these weights; megatron would fail later with a page of shape mismatches);
- the data order must be the same (tokenizer file, blend, split, seed, sequence length): the data position is a
  sample count into that order, which means nothing in another one;
- the parallel layout may change (the checkpoint is resharded), unless it was saved `dp_reshardable`;
- the global batch size, step count and LR schedule may change: the schedule is recomputed in samples from the
  resumed position (`reschedule`), so the LR follows the new settings from the next step on, and the run still ends
  after `train.train_steps` steps. When nothing changed, the scheduler is left exactly as saved.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from megagate.checkpoint import architecture
from megagate.errors import MegagateError
from megagate.run_config import MEGATRON_LR_STYLE, TrainConfig


def file_digest(path: str | os.PathLike) -> str:
    """sha256 of a file (tokenizers are small)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def data_order(cfg: TrainConfig, tokenizer: str | None) -> dict[str, Any]:
    """What fixes the order of the training samples (the data position counts samples in it)."""
    d = cfg.data
    return {
        "data.tokenizer (sha256)": None if tokenizer is None else file_digest(tokenizer),
        # file names, not paths: the same data moved to another file system is the same data
        "data.blend": None if d.blend is None else [os.path.basename(str(x)) for x in d.blend],
        "data.demo": d.demo and not d.blend,
        "data.mock": d.mock,
        "data.split": d.split,
        "seed": cfg.seed,
        "train.seq_length": cfg.train.seq_length,
    }


def _differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    return [
        f"{key} {saved.get(key)!r} -> {current.get(key)!r}"
        for key in list(dict.fromkeys([*saved, *current]))
        if saved.get(key) != current.get(key)
    ]


def _refuse(path: str, what: str, diffs: list[str], advice: str, verb: str = "resume from") -> None:
    shown = "; ".join(diffs[:3]) + (f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else "")
    raise MegagateError(f"cannot {verb} {path}: {what} differs (checkpoint -> this config: {shown}); {advice}")


def check_compatible(
    meta: dict[str, Any], cfg: TrainConfig, *, tokenizer: str | None = None, path: str = "the checkpoint"
) -> None:
    """Raise a one-line MegagateError when `cfg` cannot resume from a checkpoint with metadata `meta`
    (`tokenizer`: this run's tokenizer file, compared by content; None skips that comparison)."""
    fresh = "use another output.dir (or checkpoint.dir), or checkpoint.load=false to start from scratch"
    check_architecture(meta, cfg, path=path, advice=fresh)
    saved_data = meta.get("data_order")
    if saved_data is not None:
        current = data_order(cfg, tokenizer)
        if saved_data.get("data.tokenizer (sha256)") is None or tokenizer is None:
            current["data.tokenizer (sha256)"] = saved_data.get("data.tokenizer (sha256)")
        diffs = _differences(saved_data, current)
        if diffs:
            _refuse(path, "the training data order", diffs, fresh)
    if meta.get("optimizer_format") == "dp_reshardable":
        saved, p = meta.get("layout") or {}, cfg.parallel
        current = {
            "tp": p.tensor_model_parallel_size,
            "pp": p.pipeline_model_parallel_size,
            "ep": p.expert_model_parallel_size,
            "cp": p.context_parallel_size,
            "vpp": p.virtual_pipeline_model_parallel_size,
        }
        from megagate.distributed.layout import placement_key

        extra = placement_key(
            p, cfg.model.num_layers
        )  # expert TP and an uneven split: recorded only where set, compared both ways
        diffs = [f"{k} {saved.get(k)} -> {v}" for k, v in current.items() if k in saved and saved[k] != v]
        diffs += [f"{k} {saved.get(k)} -> {extra.get(k)}" for k in ("etp", "stages") if saved.get(k) != extra.get(k)]
        if diffs:
            _refuse(
                path,
                "the model-parallel layout of a dp_reshardable checkpoint",
                diffs,
                "resume with the saved TP/PP/EP/CP/VPP sizes (only the data-parallel size may change), or save "
                "with checkpoint.optimizer_format=fully_reshardable",
            )


ORDER_WINDOW = 32  # samples hashed to tell whether two datasets read the same samples from a position on


def order_digest(dataset: Any, start: int, count: int = ORDER_WINDOW) -> dict[str, Any] | None:
    """sha256 of the tokens of samples [start, start + count) of `dataset` (fewer at its end): stored with a
    checkpoint and compared on resume, it tells whether the rebuilt dataset continues with the same samples."""
    import numpy as np

    if dataset is None:
        return None
    end = min(len(dataset), start + count)
    digest = hashlib.sha256()
    for index in range(start, end):
        digest.update(np.ascontiguousarray(dataset[index]["tokens"].numpy(), dtype=np.int64).tobytes())
    return {"at": int(start), "count": end - start, "sha256": digest.hexdigest()}


def order_changed(saved: dict[str, Any] | None, dataset: Any) -> bool:
    """True when `dataset` reads other samples at the saved position than the checkpoint's run did."""
    if not saved or dataset is None:
        return False
    return order_digest(dataset, int(saved["at"]), int(saved["count"])) != saved


def newest_meta(root: str | os.PathLike) -> dict[str, Any] | None:
    """The metadata of the newest complete checkpoint under `root` whose metadata reads, or None."""
    from megagate import checkpoint as ckpt

    for _, path in reversed(ckpt.complete_checkpoints(root)):
        try:
            return ckpt.read_meta(path)
        except MegagateError:
            continue
    return None


def check_architecture(
    meta: dict[str, Any],
    cfg: TrainConfig,
    *,
    path: str = "the checkpoint",
    advice: str = "the weights fit only the model they were trained as",
    verb: str = "resume from",
) -> None:
    """Raise a one-line MegagateError when `cfg`'s model is not the one the checkpoint's weights belong to."""
    saved = meta.get("architecture")
    if saved is not None:
        diffs = _differences(saved, architecture(cfg))
        if diffs:
            _refuse(path, "the model", diffs, advice, verb)


def schedule(cfg: TrainConfig) -> dict[str, Any]:
    """The schedule settings stored in a checkpoint, to tell on resume whether they changed."""
    t = cfg.train
    return {
        "train.global_batch_size": t.global_batch_size,
        "train.train_steps": t.train_steps,
        "train.warmup_steps": t.warmup_steps,
        "train.lr": t.lr,
        "train.min_lr": t.min_lr,
        "train.lr_schedule": t.lr_schedule,
        "train.wsd_decay_steps": t.wsd_decay_steps,
        "train.weight_decay": t.weight_decay,
    }


def reschedule(scheduler: Any, meta: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """Make megatron's OptimizerParamScheduler (just loaded from `meta`) follow this config's schedule from the resumed
    position on; returns the changed settings ([] and the scheduler untouched when nothing changed).

    megatron counts the schedule in samples. Past steps were taken at the saved global batch size, the remaining
    ones at the new one, so a boundary at step k lies at `consumed + (k - step) * gbs` samples from now on.
    """
    saved = meta.get("schedule")
    if saved is None:
        return []
    current = schedule(cfg)
    changes = _differences(saved, current)
    if not changes:
        return []
    t = cfg.train
    step, consumed = int(meta["step"]), int(meta["consumed_samples"])
    gbs, saved_gbs = t.global_batch_size, int(saved["train.global_batch_size"])

    def samples_at(k: int) -> int:
        rate = gbs if k >= step else saved_gbs
        return max(0, consumed + (k - step) * rate)

    style = MEGATRON_LR_STYLE[t.lr_schedule]
    scheduler.max_lr, scheduler.min_lr = float(t.lr), float(t.min_lr)
    scheduler.lr_decay_style = style
    scheduler.lr_warmup_steps = samples_at(t.warmup_steps)
    scheduler.lr_decay_steps = max(samples_at(t.train_steps), scheduler.lr_warmup_steps + 1)
    scheduler.wd_incr_steps = scheduler.lr_decay_steps
    scheduler.start_wd = scheduler.end_wd = float(t.weight_decay)
    if style == "WSD":
        scheduler.wsd_decay_steps = t.wsd_steps * gbs
        scheduler.lr_wsd_decay_style = "linear"
    scheduler.step(increment=0)  # the next update's LR under the new settings
    return changes
