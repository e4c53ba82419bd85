"""`megagate train --config FILE.yaml [key=value ...] [--dry-run]`."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from megagate.errors import MegagateError

if TYPE_CHECKING:
    from megagate.run_setup import RunSetup


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML training config")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides (values parsed as YAML)")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the plan; do not train")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="world size to plan for with --dry-run (default: from the launcher environment, else 1)",
    )
    parser.add_argument(
        "--gpu", default=None, help="with --dry-run: the GPU of the memory plan (megagate plan; default h100-sxm)"
    )
    parser.add_argument("--gpus-per-node", type=int, default=8, help="with --dry-run: GPUs per node of the plan")


def describe(setup: RunSetup) -> str:
    """The resolved model, parallel layout, batch arithmetic and perf settings, as printed by --dry-run."""
    from megagate.model.counts import flops_per_token, parameter_counts

    cfg, layout = setup.cfg, setup.layout
    m, t = cfg.model, cfg.train
    counts = parameter_counts(m)
    flops = flops_per_token(m, t.seq_length)
    lines = [
        f"model: {m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_attention_heads}/{m.num_query_groups} "
        f"x {m.head_dim}, FFN {m.effective_ffn_hidden_size}"
        + (f", MoE {m.num_experts} experts top-{m.moe_router_topk} (FFN {m.moe_ffn_hidden_size})" if m.is_moe else ""),
        f"gate: {m.gate.describe()}",
        f"parameters: {counts['total']:,} total, {counts['active']:,} active, {counts['gate']:,} in gates",
        f"FLOPs per token (training): {flops:,.0f}",
        f"parallel: world {layout.world_size} = TP {layout.tp} x PP {layout.pp} x CP {layout.cp} x DP {layout.dp}; "
        f"EP {layout.ep}; VPP {cfg.parallel.virtual_pipeline_model_parallel_size or 1}; "
        f"sequence parallel {cfg.parallel.sequence_parallel}",
        f"batch: global {t.global_batch_size} = micro {t.micro_batch_size} x DP {layout.dp} x "
        f"{layout.num_microbatches} micro-batches; {t.global_batch_size * t.seq_length:,} tokens/step; "
        f"{t.train_steps} steps = {t.train_steps * t.global_batch_size * t.seq_length:,} tokens",
        f"precision {t.precision}; lr {t.lr} ({t.lr_schedule}, warmup {t.warmup_steps}, min {t.min_lr}); "
        f"clip {t.clip_grad}; weight decay {t.weight_decay}; optimizer {_optimizer_line(t)}",
        f"output: {cfg.output.dir}; checkpoints: {cfg.checkpoint_dir}",
        *setup.describe(),
    ]
    if t.precision == "fp8":
        lines.append(
            f"fp8: recipe {t.fp8_recipe}, format {setup.perf.fp8_format}; parameter gather {t.fp8_param_gather}"
            + (
                f"; bf16 first {t.num_layers_at_start_in_bf16} / last {t.num_layers_at_end_in_bf16} layers"
                if t.first_last_layers_bf16
                else ""
            )
        )
    if cfg.perf.profile.steps:
        prof = cfg.perf.profile
        lines.append(
            f"profile: steps {prof.steps[0]}-{prof.steps[1]} on ranks {prof.ranks} into "
            f"{prof.dir or os.path.join(cfg.output.dir, 'profile')}"
        )
    return "\n".join(lines)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(args: argparse.Namespace) -> int:
    if not args.dry_run:
        from megagate.train.signals import install_early

        install_early()  # before anything slow: a preemption warning during set-up must not kill the process
    from megagate import config_reader
    from megagate.machine import Machine
    from megagate.run_setup import resolve

    cfg = config_reader.load(args.config, args.overrides)
    if args.dry_run:
        world = args.world_size
        if world is None:
            world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
        elif world < 1:
            raise MegagateError(f"--world-size {world}: must be a positive number of processes")
        if args.gpus_per_node < 1:
            raise MegagateError(f"--gpus-per-node {args.gpus_per_node}: must be >= 1")
        from megagate.plan import plan

        # the set-up of the GPU nodes the config is written for (the layout check of the real run included)
        text = describe(resolve(cfg, world, Machine.target(cfg)))
        predicted = plan(cfg, world, args.gpu or "h100-sxm", gpus_per_node=min(args.gpus_per_node, world))
        print(f"{text}\nmemory plan:\n{predicted.table()}")
        return 0
    if args.gpu is not None:  # a real run trains on the devices it finds: the flag would do nothing
        raise MegagateError(f"--gpu {args.gpu} applies with --dry-run only (the memory plan's GPU)")
    import torch

    from megagate.distributed import children, launch
    from megagate.health import watchdog
    from megagate.health.progress import PROGRESS
    from megagate.train import runlock
    from megagate.train.trainer import train

    if not any(v in os.environ for v in ("RANK", "SLURM_PROCID", "MASTER_PORT")):
        os.environ["MASTER_PORT"] = str(_free_port())  # a single process: any free port, not a fixed one
    env = launch.init_process_group()
    locks: list = []
    dog = None
    try:
        # every setting decided once for this machine; a bad layout or a perf setting this GPU cannot run is refused
        # before anything is built
        setup = resolve(cfg, env.world_size)
        # one run per output directory: every rank refuses together, before anything is written
        locks = runlock.lock_for_run(cfg.output.dir, cfg.checkpoint_dir)
        # megatron's checkpoint-writer Manager ignores the stop signals and dies with this process
        children.install_checkpoint_writer_queue()
        children.install_fork_hook()  # background checkpoint writers (forked) likewise
        # progress records, hang detection, the other ranks' failures (megagate.health)
        dog = watchdog.start(cfg.watchdog, cfg.output.dir)
        try:
            train(setup)
        except BaseException as exc:
            if dog is None or isinstance(exc, KeyboardInterrupt):
                raise
            code = dog.collateral_exit()  # a hang declared, or another rank failed first and said why
            if code is None:  # another rank vanished without a word (killed): one line naming it, not a traceback
                code = dog.peer_lost(exc, _resume_point(cfg.checkpoint_dir))
            if code is not None:
                return code
            dog.publish_failure(exc)  # the other ranks exit now instead of waiting for this one in a collective
            raise
        if dog is not None and PROGRESS.snapshot().steps_done == 0:
            dog.stop_idle()  # nothing trained (a finished run rerun): no watchdog folder left behind
    finally:
        from megatron.core import parallel_state

        if dog is not None:
            dog.stop()
        children.shutdown()
        parallel_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        runlock.release_all(locks)
    return 0


def _resume_point(root: Any) -> str | None:
    """The newest complete checkpoint under `root`: where a rerun resumes (None: there is none yet)."""
    from megagate.checkpoint.naming import latest

    try:
        path = latest(root)
    except OSError:
        return None
    return None if path is None else str(path)


def _optimizer_line(t: Any) -> str:
    if t.optimizer == "muon":
        return (
            f"muon (momentum {t.muon_momentum}, {t.muon_ns_steps} Newton-Schulz steps, TP mode {t.muon_tp_mode}; "
            "AdamW on non-matrix parameters)"
        )
    return f"adamw (betas {t.adam_beta1}, {t.adam_beta2}; eps {t.adam_eps})"
