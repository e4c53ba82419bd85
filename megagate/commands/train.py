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
        help="with --dry-run: plan for a cluster of this many GPU ranks (default: this machine, with the launcher "
        "environment's world size, else 1)",
    )
    parser.add_argument(
        "--gpu",
        default=None,
        help="with --dry-run: plan for a cluster of this GPU (megagate plan's names; default h100-sxm once "
        "--world-size is given) instead of this machine",
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
        f"gate: {m.gate.describe()}"
        + (f"; softmax {m.softmax_type} (a sink in every softmax)" if m.softmax_type != "vanilla" else ""),
        f"parameters: {counts['total']:,} total, {counts['active']:,} active, {counts['gate']:,} in gates",
        f"FLOPs per token (training): {flops:,.0f}",
        f"parallel: world {layout.world_size} = TP {layout.tp} x PP {layout.pp} x CP {layout.cp} x DP {layout.dp}; "
        f"EP {layout.ep}; VPP {cfg.parallel.virtual_pipeline_model_parallel_size or 1}; "
        f"sequence parallel {cfg.parallel.sequence_parallel}",
        f"batch: global {t.global_batch_size} = micro {t.micro_batch_size} x DP {layout.dp} x "
        f"{layout.num_microbatches} micro-batches; {t.global_batch_size * t.seq_length:,} tokens/step; "
        f"{t.train_steps} steps = {t.train_steps * t.global_batch_size * t.seq_length:,} tokens",
        f"precision {t.precision}; lr {t.lr} ({t.lr_schedule}, warmup {t.warmup_steps}, min {t.min_lr}); "
        f"clip {t.clip_grad}; weight decay {t.weight_decay}; optimizer {_optimizer_line(t)}"
        + (f"; z-loss {t.z_loss_coeff:g} (train/z_loss, not in train/loss)" if t.z_loss_coeff else ""),
        f"output: {cfg.output.dir}; checkpoints: {cfg.checkpoint_dir}",
        *data_lines(cfg),
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


def data_lines(cfg: Any) -> list[str]:
    """What the run reads: the data source (demo corpus, mock tokens or the blend's datasets and weights, the split)
    and the tokenizer file."""
    from megagate.data.demo import run_tokenizer

    d = cfg.data
    if d.mock:
        source = "mock (megatron's MockGPTDataset: synthetic tokens, no files)"
    elif d.demo and not d.blend:
        source = (
            f"demo corpus (Python's own docs and code, {d.demo_max_bytes:,} bytes, BPE {d.demo_vocab_size}) "
            f"built or reused under {d.demo_dir}"
        )
    else:
        from megagate.data.loader import parse_blend

        prefixes, weights = parse_blend(d.blend)
        parts = prefixes if weights is None else [f"{w:g} x {p}" for w, p in zip(weights, prefixes, strict=True)]
        source = f"blend {', '.join(parts)}"
    tokenizer = run_tokenizer(d)
    return [
        f"data: {source}; split {d.split} (train, valid, test); loader {d.loader}",
        f"tokenizer: {tokenizer if tokenizer else 'none (mock data: token ids only)'}",
    ]


def device_line(setup: RunSetup, gpu: str | None) -> str:
    """The machine the plan describes: this one (its CPU or GPU, after the CPU switch-offs) or the target cluster."""
    t = setup.cfg.train
    precision = t.precision if t.precision == "fp8" else setup.precision
    if gpu is not None:
        return f"device: a cluster of {gpu} GPUs (the target; --gpu / --world-size), parameters {precision}"
    if setup.machine.gpu:
        import torch

        return f"device: this machine's GPU ({torch.cuda.get_device_name()}), parameters {precision}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"device: this machine's CPU ({cores} cores; gloo process groups), parameters {precision} "
        "(--gpu NAME --world-size N describes a GPU cluster instead)"
    )


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
            from megagate.distributed.utils import launcher_world_size

            world = launcher_world_size()
        elif world < 1:
            raise MegagateError(f"--world-size {world}: must be a positive number of processes")
        if args.gpus_per_node < 1:
            raise MegagateError(f"--gpus-per-node {args.gpus_per_node}: must be >= 1")
        from megagate.plan import plan

        # a target cluster when one is named (--gpu, --world-size), else this machine as the real run sees it (the
        # CPU switch-offs of kernels and perf settings included)
        gpu = args.gpu or ("h100-sxm" if args.world_size is not None else None)
        if gpu is not None:
            from megagate.plan.devices import gpu_spec

            gpu_spec(gpu)  # an unknown name refused before anything is printed
        setup = resolve(cfg, world, Machine.target(cfg) if gpu is not None else None)
        print(describe(setup))
        print(device_line(setup, gpu))
        if gpu is None and setup.machine.gpu:
            import torch

            from megagate.plan.devices import from_cuda_name

            spec = from_cuda_name(torch.cuda.get_device_name())
            gpu = spec.name if spec is not None else None
        if gpu is None:
            why = "this GPU is not in the planner's table" if setup.machine.gpu else "a CPU run"
            print(f"memory plan: none ({why}); --gpu NAME plans one")
            return 0
        predicted = plan(cfg, world, gpu, gpus_per_node=min(args.gpus_per_node, world))
        print(f"memory plan:\n{predicted.table()}")
        return 0
    if args.gpu is not None:  # a real run trains on the devices it finds: the flag would do nothing
        raise MegagateError(f"--gpu {args.gpu} applies with --dry-run only (the memory plan's GPU)")
    from megagate.distributed import children, parallel
    from megagate.health import watchdog
    from megagate.health.progress import PROGRESS
    from megagate.train import runlock
    from megagate.train.trainer import train

    with parallel.process_group() as env:
        locks: list = []
        dog = None
        try:
            # every setting decided once for this machine; a bad layout or a perf setting this GPU cannot run is
            # refused before anything is built
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
            if dog is not None:
                dog.stop()
            children.shutdown()
            runlock.release_all(locks)  # local files only: before the process group's teardown is fine
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
