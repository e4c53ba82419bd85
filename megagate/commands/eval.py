"""`megagate eval CHECKPOINT [CHECKPOINT ...] --data PREFIX[,PREFIX|@run] --seq-lengths 512,1024 [--rope k=v ...]`.

Perplexity per dataset, evaluated length and position bucket, with F-Attn / M-Act at each length; one process or
torchrun / srun like training (`--tp`, `--pp`; the rest is data parallel). Prints a table and writes
<out>/results.json, table.txt and ppl_vs_length.png. Everything the command line names is checked before any model
is built (one-line errors, exit 2).
"""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoints", nargs="+", help="checkpoints (iter_NNNNNNN), checkpoint roots or run folders")
    parser.add_argument(
        "--data",
        required=True,
        help="comma-separated indexed-dataset prefixes (all their documents), or @run: each checkpoint's own "
        "validation split",
    )
    parser.add_argument("--seq-lengths", required=True, help="comma-separated lengths to evaluate, e.g. 512,1024")
    parser.add_argument(
        "--rope",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="position-embedding overrides for every checkpoint, e.g. rotary_base=1000000 or position_embedding=yarn "
        "yarn_factor=4 (keys: the model's position fields and max_sequence_length)",
    )
    parser.add_argument("--samples", type=int, default=32, help="samples per dataset and length (default 32)")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="samples per forward (default 1)")
    parser.add_argument("--buckets", type=int, default=8, help="position buckets per window (default 8)")
    parser.add_argument(
        "--diagnostics-max-length",
        type=int,
        default=4096,
        help="F-Attn/M-Act probes up to this length (they materialise s x s attention; default 4096)",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    parser.add_argument("--seed", type=int, default=1234, help="sample-order seed for --data prefixes (default 1234)")
    parser.add_argument("--names", default=None, help="comma-separated labels of the checkpoints (plot legend)")
    parser.add_argument(
        "--out",
        default=None,
        help="output folder (default: <run>/eval, the checkpoints' run folder; several runs: required)",
    )


def run(args: argparse.Namespace) -> int:
    from megagate.commands.analyze import read_paths
    from megagate.errors import MegagateError
    from megagate.evaluate import options
    from megagate.files import refuse_own_input

    if args.out is not None:  # the default, <run>/eval, is beside the checkpoints
        inputs = [("checkpoint", c) for c in read_paths(args.checkpoints)]
        refuse_own_input(args.out, inputs, replaces=getattr(args, "force", False))

    for flag, value, low in (
        ("--samples", args.samples, 1),
        ("--micro-batch-size", args.micro_batch_size, 1),
        ("--buckets", args.buckets, 1),
        ("--tp", args.tp, 1),
        ("--pp", args.pp, 1),
        ("--diagnostics-max-length", args.diagnostics_max_length, 0),
        ("--seed", args.seed, 0),
    ):
        if value < low:
            raise MegagateError(f"{flag} {value}: must be >= {low}")
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise MegagateError(f"--out {args.out}: exists and is not a folder")
    lengths = options.parse_lengths(args.seq_lengths)
    if args.buckets > min(lengths):
        raise MegagateError(
            f"--buckets {args.buckets}: more position buckets than positions in the shortest --seq-lengths window "
            f"({min(lengths)}); give at most {min(lengths)}"
        )
    rope = options.parse_rope(args.rope)
    names = None if args.names is None else [n.strip() for n in args.names.split(",")]
    if names is not None and len(names) != len(args.checkpoints):
        raise MegagateError(f"--names {args.names!r}: {len(names)} names for {len(args.checkpoints)} checkpoints")
    specs = options.parse_data(args.data, lengths, "0,1,0")

    from megagate.distributed.utils import launcher_world_size
    from megagate.evaluate import core
    from megagate.model.model_config import ParallelConfig

    prepared = [
        core.prepare(c, rope, lengths, None if names is None else names[i]) for i, c in enumerate(args.checkpoints)
    ]
    if args.out is None:  # the checkpoints are known good now: their run folder
        from megagate.commands.analyze import default_out

        args.out = default_out(args.checkpoints, "eval")
    world = launcher_world_size()
    parallel = ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    dp = core.check_layout(prepared, parallel, world)
    opts = core.Options(
        lengths=lengths,
        samples=args.samples,
        micro_batch_size=args.micro_batch_size,
        buckets=args.buckets,
        diagnostics_max_length=args.diagnostics_max_length,
        seed=args.seed,
        cache_dir=os.path.join(args.out, "data_cache"),
        parallel=parallel,
    )

    from megagate.distributed import megatron_cpu
    from megagate.distributed.parallel import initialize_model_parallel, process_group
    from megagate.distributed.utils import barrier, launcher_rank

    if launcher_rank() == 0:
        core.prebuild(prepared, specs, opts)  # complete index caches before any other rank reads them
    with process_group() as env:
        megatron_cpu.install()
        initialize_model_parallel(parallel, seed=args.seed)
        rank0 = env.rank == 0
        results = core.evaluate(prepared, specs, opts, dp, log=print if rank0 else (lambda _: None))
        if rank0:
            from megagate.evaluate import output

            paths = output.write(results, args.out)
            print(output.table(results))
            print(f"results: {paths['json']}, plot: {paths['png']}")
        barrier()
    return 0
