"""`megagate demo`: tiny gated GPTs on CPU over real text (bytes of the Python stdlib's docs and code).

Builds one tiny megatron GPTModel per gate variant from the gated layer spec, trains each for a few AdamW steps on
the same byte-level batches, and prints parameter counts, losses and the gates' score statistics.
"""

from __future__ import annotations

import argparse
import time

import torch

DEFAULT_VARIANTS = ("baseline", "g1-elementwise", "g1-headwise", "g2-elementwise", "g5-elementwise")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megagate import gate as gates

    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(gates.PRESETS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)


def byte_batches(text: bytes, steps: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    """`steps` random windows of seq+1 bytes each (token ids 0..255), reproducible from `seed`."""
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq - 1, (steps, batch), generator=gen)
    return [torch.stack([data[s : s + seq + 1] for s in row.tolist()]) for row in starts]


def run(args: argparse.Namespace) -> int:
    from megagate import gate as gates
    from megagate import models, parallel
    from megagate.data.corpus import build_documents

    text = "\n\n".join(d["text"] for d in build_documents(max_bytes=1_000_000)).encode("utf-8")
    batches = byte_batches(text, args.steps + 1, args.batch_size, args.seq_length, args.seed)
    probe, batches = batches[0], batches[1:]
    position_ids = torch.arange(args.seq_length).unsqueeze(0).expand(args.batch_size, -1)
    print(f"corpus: {len(text):,} bytes of Python stdlib docstrings, code and licenses; "
          f"{args.steps} steps x {args.batch_size} x {args.seq_length} byte tokens\n")  # fmt: skip
    header = f"{'variant':28s} {'params':>9s} {'loss@1':>7s} {'loss@end':>8s} {'gate mean':>9s} {'<0.1':>6s} {'s/step':>7s}"
    print(header + "\n" + "-" * len(header))
    with parallel.single_process(seed=args.seed):
        for name in args.variants:
            torch.manual_seed(args.seed)
            model_cfg = models.model_preset("tiny", gate=gates.preset(name), vocab_size=256)
            model = models.build_gpt_model(model_cfg, models.transformer_config(model_cfg))
            optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
            losses, start = [], time.perf_counter()
            for batch in batches:
                loss = model(batch[:, :-1], position_ids, None, labels=batch[:, 1:]).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            per_step = (time.perf_counter() - start) / len(batches)
            scores: list[torch.Tensor] = []
            for layer in model.decoder.layers:
                layer.self_attention.score_observer = lambda module, s: scores.append(s.flatten())
            with torch.no_grad():
                model(probe[:, :-1], position_ids, None)
            mean = sparsity = "-"
            if scores:
                all_scores = torch.cat(scores)
                mean, sparsity = f"{all_scores.mean():.3f}", f"{(all_scores < 0.1).float().mean():.3f}"
            params = sum(p.numel() for p in model.parameters())
            print(f"{name:28s} {params:>9,} {losses[0]:>7.3f} {losses[-1]:>8.3f} {mean:>9s} {sparsity:>6s} {per_step:>7.3f}")
    return 0
