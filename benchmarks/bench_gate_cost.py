"""What megagate's G1 gate costs next to megatron-core's own output gate (`attention_output_gate=True`), same weights.

    .venv/bin/python benchmarks/bench_gate_cost.py [--rounds 12] [--steps-per-round 4] [--warmup 3] [--quick]

Two GPTModels of 4 layers, hidden 256 (8 query heads x 32 in 4 KV groups, FFN 768, sequence 256, batch 4): one built
by megagate with the G1-elementwise gate, one from the *same* layer spec with only the attention module put back to
megatron's `SelfAttention` and `attention_output_gate=True` in its config, so the two differ in the gate's code path
alone (core attention, norms and MLP are the same modules). megatron's weights are loaded into megagate's model
through `qkv_layout.from_megatron_output_gate`; the losses must agree (printed). A step is forward + backward of the
mean LM loss.

Printed: ATen operations per step (counted with a TorchDispatchMode: every kernel-level op the step dispatches, views
included) for each model and the op names whose counts differ; then step times, interleaved: each round steps both
models `--steps-per-round` times in an order that alternates every round (a machine that gets busier or quieter
affects both alike), after `--warmup` untimed steps; the median step time of each, and the median over rounds of the
per-round ratio megagate / megatron. `--quick` (2 layers, sequence 32, 2 rounds of 1 step) checks that it runs.
No assertions: tests/model/test_gate_cost.py asserts on the op counts.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_train import quiet_stdout  # noqa: E402  (gloo prints a line per process group)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

FULL = dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4, head_dim=32, ffn_hidden_size=768)
QUICK = dict(FULL, num_layers=2)


@dataclasses.dataclass
class Pair:
    """megagate's G1 model, megatron's output-gate model with the same weights, and one batch for both."""

    megagate: torch.nn.Module
    megatron: torch.nn.Module
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # tokens, position ids, labels


def build_pair(seq: int = 256, batch: int = 4, seed: int = 0, variant: str = "g1-elementwise", **shape: int) -> Pair:
    """Both models (inside a megatron world), megatron's weights copied into megagate's. `variant`: megagate's
    "g1-elementwise" against megatron's output gate, or "baseline" against megatron's ungated attention."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megagate.model import gate as gates
    from megagate.model import qkv_layout
    from megagate.model.presets import model_preset
    from megagate.model.spec import gated_decoder_block_spec
    from megagate.model_factory import build_model
    from megagate.run_config import DataSection, TrainConfig
    from megagate.run_setup import resolve

    shape = {**FULL, **shape}
    if variant not in ("g1-elementwise", "baseline"):
        raise ValueError(f"variant={variant!r}: megatron has a counterpart for g1-elementwise and baseline only")
    model = model_preset("tiny", gate=gates.preset(variant), max_sequence_length=max(seq, 128), **shape)
    setup = resolve(TrainConfig(model=model, data=DataSection(mock=True)), None)
    config = setup.transformer_config()
    torch.manual_seed(seed)
    (ours,) = build_model(setup, initialise=False)  # megatron's own initialisation, as `theirs` below

    # megatron's own gate: the same block spec, the attention module put back to megatron's SelfAttention
    mc_config = dataclasses.replace(config, attention_output_gate=variant == "g1-elementwise")
    block = gated_decoder_block_spec(mc_config, model.gate)
    for layer in block.layer_specs:
        attention = layer.submodules.self_attention
        params = {k: v for k, v in attention.params.items() if k != "gate"}
        layer.submodules.self_attention = ModuleSpec(
            module=SelfAttention, params=params, submodules=attention.submodules
        )
    theirs = GPTModel(
        config=mc_config,
        transformer_layer_spec=block,
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_sequence_length,
        share_embeddings_and_output_weights=model.tie_embeddings,
        position_embedding_type=model.position_embedding,
        rotary_base=model.rotary_base,
        rotary_percent=model.rotary_percent,
    )
    from megagate.model.loss import use_local_cross_entropy

    use_local_cross_entropy(
        theirs
    )  # the loss megagate's factory gives a TP = 1 model: the pair differs in attention only
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in theirs.parameters():  # norm weights and all: every path carries non-trivial values
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    state = dict(theirs.state_dict())
    n, g, d = model.num_attention_heads, model.num_query_groups, model.head_dim
    for key in [k for k in state if k.endswith("self_attention.linear_qkv.weight") and mc_config.attention_output_gate]:
        state[key] = qkv_layout.from_megatron_output_gate(state[key], n, g, d)
    ours.load_state_dict(state)
    tokens = torch.randint(0, model.vocab_size, (batch, seq + 1), generator=gen)
    positions = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    return Pair(ours, theirs, (tokens[:, :-1].contiguous(), positions, tokens[:, 1:].contiguous()))


def step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> float:
    """Forward + backward of the mean LM loss; returns the loss."""
    tokens, positions, labels = batch
    model.zero_grad(set_to_none=True)
    loss = model(tokens, positions, None, labels=labels).float().mean()
    loss.backward()
    return loss.item()


class OpCounter(TorchDispatchMode):
    """Counts every ATen op dispatched while active (forward and autograd's backward alike), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count_ops(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> collections.Counter:
    """ATen ops of one step, by name (one warm-up step first, so that lazily built state is not counted)."""
    step(model, batch)
    counter = OpCounter()
    with counter:
        step(model, batch)
    return counter.counts


def time_interleaved(pair: Pair, rounds: int, steps_per_round: int, warmup: int) -> dict[str, list[float]]:
    """Per-round median step times (s) of each model, the two models alternating first in successive rounds."""
    models = {"megagate": pair.megagate, "megatron": pair.megatron}
    for model in models.values():
        for _ in range(warmup):
            step(model, pair.batch)
    per_round: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            times = []
            for _ in range(steps_per_round):
                start = time.perf_counter()
                step(models[name], pair.batch)
                times.append(time.perf_counter() - start)
            per_round[name].append(statistics.median(times))
    return per_round


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps-per-round", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2 layers, sequence 32, 2 rounds of 1 step")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps_per_round, args.warmup = 2, 1, 1
    shape, seq = (QUICK, 32) if args.quick else (FULL, 256)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    from megagate.distributed import parallel

    with contextlib.ExitStack() as stack:
        with quiet_stdout():
            stack.enter_context(parallel.single_process())
            pair = build_pair(seq=seq, **shape)
        loss_ours, loss_theirs = step(pair.megagate, pair.batch), step(pair.megatron, pair.batch)
        print(
            f"model: {shape['num_layers']} layers, hidden {shape['hidden_size']}, "
            f"{shape['num_attention_heads']}/{shape['num_query_groups']} heads x {shape['head_dim']}, seq {seq}, "
            f"batch {pair.batch[0].shape[0]}; loss megagate {loss_ours:.6f} megatron {loss_theirs:.6f} "
            f"(|diff| {abs(loss_ours - loss_theirs):.2e})"
        )
        ours, theirs = count_ops(pair.megagate, pair.batch), count_ops(pair.megatron, pair.batch)
        total_ours, total_theirs = sum(ours.values()), sum(theirs.values())
        print(
            f"ops per step: megagate {total_ours}, megatron {total_theirs} "
            f"(megagate - megatron = {total_ours - total_theirs:+d}, ratio {total_ours / total_theirs:.3f})"
        )
        diff = {k: ours[k] - theirs[k] for k in set(ours) | set(theirs) if ours[k] != theirs[k]}
        for name, delta in sorted(diff.items(), key=lambda kv: (-abs(kv[1]), kv[0])):
            print(f"  {name:40s} megagate {ours[name]:5d}  megatron {theirs[name]:5d}  ({delta:+d})")
        per_round = time_interleaved(pair, args.rounds, args.steps_per_round, args.warmup)
    med = {name: statistics.median(t) for name, t in per_round.items()}
    ratios = [a / b for a, b in zip(per_round["megagate"], per_round["megatron"])]
    print(
        f"step time (median of {args.rounds} rounds x {args.steps_per_round} steps): "
        f"megagate {med['megagate'] * 1e3:.2f} ms, megatron {med['megatron'] * 1e3:.2f} ms"
    )
    print(
        f"ratio megagate/megatron: {statistics.median(ratios):.3f} (median of per-round ratios; "
        f"min {min(ratios):.3f}, max {max(ratios):.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
