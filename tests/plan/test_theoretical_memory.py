"""The planner against Megatron-LM's own estimator, `megatron/training/theoretical_memory_usage.py`, side by side.

For the paper's three models under the issue's layouts, megatron's `compute_weight_and_optimizer_memory`,
`compute_activation_memory` (sequence parallel + selective recompute, Korthikanti et al. Table 2) and
`compute_activation_memory_without_sp` are called on the `args` helpers.megatron_reference builds from the same
config, and every difference to the planner's stage-0 (megatron's "most loaded shard", the first pipeline stage)
figures is asserted as an exact sum of named, explained terms (docs/planning.md, "Against megatron's
theoretical_memory_usage.py"). `pytest -s` prints the tables.

* parameters: megatron's count equals the planner's minus the gate parameters and the QK-norm weights (no term for
  either), plus the final norm spread as h / PP over the stages (its "replicated parameters / PP");
* weight + optimizer bytes: megatron's 6 + 12/DP bytes per parameter (18 without the distributed optimizer) on its
  count; the planner also pays for megatron's 64-element alignment and lcm(DP, 128) bucket padding, and for the
  largest (not the mean) optimizer shard;
* activations per layer: each of megatron's Table-2 terms next to the planner's items, with the reason they differ
  (GQA, query width n·d ≠ h, RoPE, QK-norm, the gate, no dropout, SwiGLU, fp32 1/rms, the fused qkv output that
  selective recompute keeps, MoE); both columns are asserted to sum to the real functions' results;
* activations of the stage: megatron's in-flight layer count equals the planner's, and the embedding, output-layer
  and planner-only items differ by the amounts named.
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest

from helpers.megatron_reference import megatron_args
from megagate import config_reader, run_config
from megagate.model.gate_params import gate_parameters
from megagate.plan import memory as mem
from megagate.plan import plan
from megagate.plan.params import rank_buffers

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    from megatron.training import theoretical_memory_usage as tmu

CONFIG = "slurm/examples/configs/15a2b_moe.yaml"
DENSE = ["parallel.expert_model_parallel_size=1"]
CASES = {
    # name: (world size, overrides of the 15A2B example config)
    "15a2b TP1 EP8 / 64": (64, []),
    "15a2b TP2 PP2 EP8 / 64": (
        64,
        ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"],
    ),
    "15a2b PP4 EP16 / 128": (
        128,
        ["parallel.pipeline_model_parallel_size=4", "parallel.expert_model_parallel_size=16"],
    ),
    "1.7b-28l TP2 PP2 / 64": (
        64,
        [
            "model.preset=1.7b-28l",
            *DENSE,
            "parallel.tensor_model_parallel_size=2",
            "parallel.pipeline_model_parallel_size=2",
        ],
    ),
    "1.7b-48l TP2 PP4 VPP2 / 32": (
        32,
        [
            "model.preset=1.7b-48l",
            *DENSE,
            "parallel.tensor_model_parallel_size=2",
            "parallel.pipeline_model_parallel_size=4",
            "parallel.virtual_pipeline_model_parallel_size=2",
        ],
    ),
}


def _cfg(case: str, *extra: str):
    world, overrides = CASES[case]
    base = ["train.micro_batch_size=1", "train.backend=te", *overrides, *extra]
    cfg = config_reader.load(CONFIG, base, environment=False)
    return cfg, run_config.layout(cfg, world), world


def _with(args: SimpleNamespace, **changes: object) -> SimpleNamespace:
    return SimpleNamespace(**{**vars(args), **changes})  # megatron's functions mutate args (num_query_groups)


def _gate_params_per_layer(model) -> int:
    entries = gate_parameters(model.gate, model.hidden_size, model.num_attention_heads, model.num_query_groups,
                              model.head_dim)  # fmt: skip
    return sum(e.numel for e in entries)


# --- parameters and weight + optimizer bytes ------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_parameters_and_weight_optimizer_bytes(case: str) -> None:
    cfg, layout, world = _cfg(case)
    m, args = cfg.model, megatron_args(cfg, layout)
    role = plan(cfg, world, "h100").roles[0]
    # megatron's count on the most loaded shard: without the distributed optimizer every parameter costs 18 bytes
    megatron_total = tmu.compute_weight_and_optimizer_memory(_with(args, use_distributed_optimizer=False)) / 18
    megatron_bytes = tmu.compute_weight_and_optimizer_memory(_with(args))
    t, pp, layers = layout.tp, layout.pp, m.num_layers // layout.pp
    expert_dp, dp = layout.expert_dp, layout.dp
    # the explained parameter differences (dense side; expert weights agree exactly)
    gates = layers * _gate_params_per_layer(m) // t  # every gate parameter of these presets is TP-sharded (G1 rows)
    qk_norm = layers * 2 * m.head_dim if m.qk_layernorm else 0  # q_layernorm + k_layernorm, replicated
    final_norm = m.hidden_size / pp if pp > 1 else 0  # megatron: final norm / PP on every stage; planner: last stage
    assert role.params - megatron_total == pytest.approx(gates + qk_norm - final_norm, abs=1e-3)
    # weight + optimizer bytes: 6 + 12/DP per parameter on megatron's count; the planner pays padding and the largest
    # shard of its exact buffers
    bufs = rank_buffers(m, _shape(layout), 0, True)
    padding = sum(b.numel - b.numel_unpadded for b in bufs)
    shard_excess = sum(12 * (b.max_owned() - b.numel_unpadded / b.dp) for b in bufs)
    param_delta = (gates + qk_norm - final_norm) * (6 + 12 / dp)
    planner_bytes = sum(role.items[k] for k in ("weights (bf16)", "gradient buffer (fp32)",
                                               "optimizer shard (Adam + fp32 main)"))  # fmt: skip
    assert planner_bytes - megatron_bytes == pytest.approx(6 * padding + shard_excess + param_delta, abs=1.0)
    expert = role.expert_params
    if expert_dp != dp:  # separate megatron's dense and expert counts: its two byte rates differ
        dense_m = (megatron_bytes - megatron_total * (6 + 12 / expert_dp)) / (12 / dp - 12 / expert_dp)
        assert megatron_total - dense_m == pytest.approx(expert, abs=1e-2)  # experts: exactly the planner's
    print(
        f"\n{case}: parameters stage 0 planner {role.params:,} (expert {expert:,}) megatron {megatron_total:,.0f}; "
        f"difference = gates {gates:,} + QK-norm {qk_norm:,} - final norm/PP {final_norm:,.0f}\n"
        f"  weight+optimizer GB: planner {planner_bytes / 1e9:.3f} megatron {megatron_bytes / 1e9:.3f}; difference = "
        f"params {param_delta / 1e9:.4f} + padding x 6 B {6 * padding / 1e9:.4f} + largest shard {shard_excess / 1e9:.4f}"
    )


def _shape(layout):
    from megagate.plan.params import RankShape

    return RankShape(layout.tp, layout.pp, layout.vpp, layout.ep, layout.cp, layout.dp, layout.expert_dp)


# --- activations ----------------------------------------------------------------------------------------------------
def layer_terms(m, s: int, b: int, t: int, sp: bool, recompute: str | None, formula: str, F: int) -> list[tuple]:
    """(term, megatron bytes, planner bytes, why) for one layer on one TP rank, GPU_TE kernels, bf16.

    `formula`: "sp" = compute_activation_memory (its terms all / TP), "no-sp" = compute_activation_memory_without_sp
    (norms, their inputs and dropout masks unsplit; Q/K/V, projection and MLP / TP with the MLP fixed at 16·s·b·h,
    i.e. ffn = 4h whatever ffn_hidden_size is). The planner column re-derives memory.layer_items independently.
    """
    a, u, h, d = 2, s * b, m.hidden_size, m.head_dim
    n, g = m.num_attention_heads // t, m.num_query_groups // t
    tok = u // t if sp else u  # tokens in the sequence domain
    tm = t if formula == "sp" else 1  # megatron's divisor of the sequence-domain terms
    gate_rows = sum(e.numel for e in gate_parameters(m.gate, h, m.num_attention_heads, m.num_query_groups, d)
                    if e.in_linear_qkv) // h // t  # fmt: skip
    qkv_out = a * u * ((n + 2 * g) * d + gate_rows)
    sel = recompute == "selective"
    rows = [
        ("2 norm inputs + qkv/MLP inputs", 8 * u * h / tm, 8 * tok * h + 8 * tok,
         "planner adds each fused norm's fp32 1/rms (4 B/token)"),
        ("dropout masks (attention, MLP)", 2 * u * h / tm, 0, "megagate trains without dropout"),
        ("Q, K, V", 6 * u * h / t,
         a * u * (n + g) * d + qkv_out + 4 if sel else a * u * (n + 2 * g) * d + 4 * b * n * s,
         "GQA k/v are g·d wide, q is n·d (not h); selective keeps RoPE'd q, k and the whole fused qkv output (v is a "
         "view of it, gate rows included); flash also keeps its fp32 log-sum-exp"),
        ("attention output (linear_proj input)", 2 * u * h / t, a * u * n * d, "n·d wide, not h"),
        ("QK-norm", 0, a * u * (n + g) * d + 4 * u * (n + g) if m.qk_layernorm else 0, "no QK-norm term"),
        ("RoPE cos/sin", 0, 4 * a * s * d, "no RoPE term"),
        ("gate: fp32 scores + gated input", 0, 4 * u * n * m.gate.width(d) + a * u * n * d if m.gate.enabled else 0,
         "no gate term (G1: fp32 sigmoid + the SDPA output it multiplies; under flash without selective the output "
         "is flash's own, counted once)"),
    ]  # fmt: skip
    if m.gate.enabled and not sel:
        rows[-1] = (*rows[-1][:2], 4 * u * n * m.gate.width(d), rows[-1][3])  # flash keeps the output: shared
    mlp_m = 4 * u * F / t if formula == "sp" else 16 * u * h / t
    if m.is_moe:
        shape = mem.ActivationShape(s, b, t, sp, a)
        items = mem.layer_items(m, shape, mem.GPU_TE, recompute)
        moe = items["router + dispatcher"] + items["experts (permuted tokens + FFN)"]
        rows.append(("MLP interior", mlp_m, moe, "no MoE term: megatron counts a dense FFN of ffn_hidden_size; the "
                     "planner's router, dispatcher and top-k tokens through the experts (value taken as is)"))  # fmt: skip
    else:
        f = m.effective_ffn_hidden_size // t
        rows.append(("MLP interior", mlp_m, 3 * a * u * f,
                     "SwiGLU: fc1's output is 2·ffn wide, kept by the fused SwiGLU, + fc2's input"))  # fmt: skip
    return rows


def _megatron_per_layer(fn, args: SimpleNamespace, micro: int) -> float:
    one = _with(args, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None, num_layers=1)
    two = _with(one, num_layers=2)
    return fn(two, micro) - fn(one, micro)  # the output-layer and embedding terms cancel


@pytest.mark.parametrize("formula", ["sp", "no-sp"])
@pytest.mark.parametrize("case", list(CASES))
def test_activation_terms(case: str, formula: str) -> None:
    # megatron's SP formula assumes sequence parallelism + selective recompute: plan that; the other, neither
    extra = ["model.recompute_granularity=selective"] if formula == "sp" else []
    cfg0, layout0, _ = _cfg(case)
    sp = formula == "sp" and layout0.tp > 1
    cfg, layout, world = _cfg(case, *extra, f"parallel.sequence_parallel={str(sp).lower()}")
    m, t, tr = cfg.model, layout.tp, cfg.train
    args = megatron_args(cfg, layout)
    s, b, micro = tr.seq_length, tr.micro_batch_size, layout.num_microbatches
    fn = tmu.compute_activation_memory if formula == "sp" else tmu.compute_activation_memory_without_sp
    overhead = 1.0 if formula == "sp" else 1.05  # without_sp multiplies everything by 1.05
    rows = layer_terms(m, s, b, t, sp, m.recompute_granularity, formula, args.ffn_hidden_size)
    megatron_layer = _megatron_per_layer(fn, args, micro)
    shape = mem.ActivationShape(s, b, t, sp, 2)
    planner_layer = mem.layer_bytes(m, shape, mem.GPU_TE, m.recompute_granularity)
    # both columns are the real functions' results, term by term
    assert sum(r[1] for r in rows) * overhead == pytest.approx(megatron_layer, rel=1e-12)
    assert sum(r[2] for r in rows) == planner_layer
    width = max(len(r[0]) for r in rows)
    print(f"\n{case}, megatron {fn.__name__} vs planner (gpu-te, recompute {m.recompute_granularity}, SP {sp}), MiB:")
    for name, mb, pb, why in rows:
        print(f"  {name:<{width}s} {mb / 2**20:10.1f} {pb / 2**20:10.1f}  {why}")
    print(f"  {'per layer':<{width}s} {megatron_layer / 2**20:10.1f} {planner_layer / 2**20:10.1f}")

    # the stage: megatron's first stage against the planner's stage 0
    role = plan(cfg, world, "h100").roles[0]
    pp, vpp = layout.pp, layout.vpp
    factor = 1 + (pp - 1) / (pp * vpp) if vpp else min(1, micro / pp)
    per_chunk = m.num_layers // (pp * (vpp or 1))
    in_flight_layers = role.in_flight * per_chunk
    assert in_flight_layers == pytest.approx(m.num_layers * factor)  # the same layers in flight on the first stage
    megatron_total = fn(_with(args), micro)
    # token ids + the embedding's dropout mask, PP micro-batches (the SP formula divides them by TP too)
    embed_m = (8 * s * b * pp + s * b * m.hidden_size * pp) * factor / (t if formula == "sp" else 1) * overhead
    if pp == 1:
        out_m = (4 * s * b * m.hidden_size * (1 + m.vocab_size / m.hidden_size) / t if formula == "sp"
                 else 2 * (s * b * m.vocab_size / t + s * b * m.hidden_size) * overhead)  # fmt: skip
    else:
        out_m = 0  # its output layer is on the last stage; megatron estimates the first only
    assert megatron_total == pytest.approx(megatron_layer * in_flight_layers + embed_m + out_m, rel=1e-12)
    planner_only = {k: v for k, v in role.items.items() if k.startswith("activations") and "layers" not in k}
    assert role.items["activations: layers (x chunk forwards in flight)"] == in_flight_layers * planner_layer
    planner_total = role.activations
    print(
        f"  stage 0: megatron {megatron_total / 2**30:.2f} GiB = {in_flight_layers:g} layers + embedding "
        f"{embed_m / 2**20:.1f} MiB + output {out_m / 2**20:.1f} MiB; planner {planner_total / 2**30:.2f} GiB = "
        f"{in_flight_layers:g} layers + "
        + ", ".join(f"{k.removeprefix('activations: ')} {v / 2**20:.1f} MiB" for k, v in planner_only.items())
    )
    assert math.isclose(
        planner_total - megatron_total,
        in_flight_layers * (planner_layer - megatron_layer) + sum(planner_only.values()) - embed_m - out_m,
        rel_tol=1e-9,
    )


@pytest.mark.parametrize("ep_overlap", [False, True])
def test_chunks_in_flight_are_megatrons_warmup_plus_one(ep_overlap: bool) -> None:
    """The planner's chunk forwards in flight on each stage are megatron's own warm-up count (its schedules'
    `get_pp_rank_microbatches`, group size PP) plus the one of the steady state; the EP A2A overlap warms up one
    chunk more, so the overlap's layouts hold one chunk of activations more."""
    from megatron.core.pipeline_parallel import schedules

    checked = 0
    for pp in (2, 4, 8):
        for vpp in (2, 3, 6):
            for rank in range(pp):
                microbatches = 4 * pp
                group = SimpleNamespace(size=lambda pp=pp: pp, rank=lambda rank=rank: rank)
                p2p = SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vpp)
                _, _, warmup, _ = schedules.get_pp_rank_microbatches(
                    microbatches, vpp, pp, overlap_moe_expert_parallel_comm=ep_overlap, p2p_communicator=p2p
                )
                assert mem.in_flight(pp, rank, vpp, microbatches, ep_overlap) == warmup + 1, (pp, vpp, rank)
                checked += 1
    assert checked == 3 * (2 + 4 + 8)
