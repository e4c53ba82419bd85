"""The step-time model on constructed cases whose answer is computed by hand: the pipeline's stage imbalance, the
overlap of data-parallel and expert-parallel communication, and where the topology puts a group's traffic."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megagate.errors import ConfigError
from megagate.model import gate as gates
from megagate.model.model_config import ModelConfig
from megagate.plan import comm, schedule
from megagate.plan.profile import AttentionCurve, Curve, DeviceProfile, Host, Link
from megagate.plan.time import step_time
from megagate.plan.work import Workload, stage_parameters

FAST = 1e30  # a rate that makes a term vanish


def only_gemms(rate: float = 1e12) -> DeviceProfile:
    """A device whose only cost is GEMM FLOPs at `rate` (no latency, no size penalty, free memory traffic and
    links, no host overhead): every step time below is then 3 x GEMM FLOPs / rate."""
    return DeviceProfile(
        name="gemm-only",
        kind="cpu",
        memory_bytes=10**15,
        gemm={"fp32": Curve(rate, 0.0, 0.0), "bf16": Curve(rate, 0.0, 0.0)},
        grouped_gemm={},
        attention={"sdpa": AttentionCurve(FAST, 0.0)},
        memory_bandwidth=FAST,
        intra=Link(0.0, FAST),
        inter=Link(0.0, FAST),
        host=Host(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, serial=True),
    )


# h 64, 4 heads of 16 (2 KV groups), SwiGLU FFN 128, vocabulary 4096: by hand, per token and layer forward
#   linear_qkv 2 x 64 x (4 + 2 x 2) x 16 = 16,384; linear_proj 2 x 64 x 64 = 8,192; fc1 2 x 64 x 256 = 32,768;
#   fc2 2 x 128 x 64 = 16,384  -> 73,728 FLOPs; the output layer 2 x 64 x 4096 = 524,288 FLOPs (7.1 layers' worth)
MODEL = ModelConfig(
    num_layers=8,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    ffn_hidden_size=128,
    vocab_size=4096,
    qk_layernorm=False,
    tie_embeddings=False,
    gate=gates.preset("baseline"),
)
LAYER_FLOPS, OUTPUT_FLOPS = 73_728, 524_288


def test_stage_imbalance_sets_the_pace_of_the_pipeline() -> None:
    """PP 2 over 8 layers: stage 0 has 4 layers, stage 1 4 layers + the output layer. With T = 2 x 128 tokens per
    micro-batch and forward + backward = 3 x the forward FLOPs at 1 TFLOP/s:
        W0 = 3 x 256 x 4 x 73,728 / 1e12,   W1 = W0 + 3 x 256 x 524,288 / 1e12,
    and 1F1B over M = 8 micro-batches takes (M - 1) x max(W) + W0 + W1 (the slow stage paces the steady state)."""
    w = Workload(MODEL, seq=128, micro_batch=2, global_batch=16, pp=2, precision="fp32", attention="sdpa")
    st = step_time(w, only_gemms(), ranks_per_node=2)
    tokens = 256
    w0 = 3 * tokens * 4 * LAYER_FLOPS / 1e12
    w1 = w0 + 3 * tokens * OUTPUT_FLOPS / 1e12
    assert st.stages[0].work == pytest.approx(w0, rel=1e-9)
    assert st.stages[1].work == pytest.approx(w1, rel=1e-9)
    assert st.bottleneck == 1
    assert st.total == pytest.approx(7 * w1 + w0 + w1, rel=1e-9)
    # the bubble term is what the schedule adds over the slow stage's own M x W1
    assert st.terms["pipeline bubble"] == pytest.approx((7 * w1 + w0 + w1) - 8 * w1, rel=1e-9)
    # moving two layers off the heavy last stage (megatron's uneven split) is faster, as hand-computed
    uneven = dataclasses.replace(w, stage_layers=((6,), (2,)))
    st2 = step_time(uneven, only_gemms(), ranks_per_node=2)
    v0, v1 = 3 * tokens * 6 * LAYER_FLOPS / 1e12, 3 * tokens * (2 * LAYER_FLOPS + OUTPUT_FLOPS) / 1e12
    assert st2.total == pytest.approx(7 * max(v0, v1) + v0 + v1, rel=1e-9)
    assert st2.total < st.total


def test_interleaved_schedule_formula() -> None:
    """Equal stages: W x (M + (PP - 1) / V); the slowest stage of unequal ones costs M x (max - mean) more."""
    assert schedule.pipeline_seconds([1.0] * 4, 8, 1) == pytest.approx(8 + 3)
    assert schedule.pipeline_seconds([1.0] * 4, 8, 2) == pytest.approx(8 + 3 / 2)
    assert schedule.pipeline_seconds([1.0, 1.0, 1.0, 2.0], 8, 1) == pytest.approx(7 * 2 + 5)


def test_megatron_layer_splits() -> None:
    # Qwen3-235B: 94 layers, embedding and loss counted as layers: 96 over PP 8 x VPP 4 = 3 each
    grid = schedule.split_layers(94, 8, 4, account_for_embedding=True, account_for_loss=True)
    assert grid[0] == (2, 3, 3, 3) and grid[7] == (3, 3, 3, 2) and sum(map(sum, grid)) == 94
    assert schedule.split_layers(24, 3, first=6, last=10) == ((6,), (8,), (10,))
    with pytest.raises(
        ConfigError, match=r"num_layers \(94\) must be divisible by pipeline stages x virtual stages \(8\)"
    ):
        schedule.split_layers(94, 8)


def test_data_parallel_overlap_hides_all_but_the_last_bucket() -> None:
    """DP 4 in one node at 1 GB/s, no latency. The tiny model's stage parameters by hand (below): the fp32
    gradient reduce-scatter moves 4 x P x 3/4 bytes, the bf16 parameter all-gather 2 x P x 3/4. Without overlap
    both are exposed; with overlap behind a long enough window only the last of the 4 buckets is; behind a
    short window what the window cannot hide."""
    model = dataclasses.replace(MODEL, num_layers=2, vocab_size=256)
    w = Workload(model, seq=64, micro_batch=1, global_batch=4, dp=4, precision="bf16", bucket_size=27_000)
    # per layer: linear_qkv 64 x 128 + linear_proj 64 x 64 + 2 norms x 64 + SwiGLU 3 x 64 x 128 = 36,992;
    # embedding 256 x 64; the untied output layer 256 x 64 + the final norm 64
    params = 2 * 36_992 + 256 * 64 + 256 * 64 + 64
    assert stage_parameters(w, 0) == (params, 0)
    topo = comm.Topology(8, Link(0.0, 1e9), Link(0.0, 1e9))
    rs, ag = 4 * params * 0.75 / 1e9, 2 * params * 0.75 / 1e9
    buckets = math.ceil(params / 27_000)
    assert buckets == 4
    off = comm.dp_seconds(dataclasses.replace(w, overlap_grad_reduce=False, overlap_param_gather=False), topo, 0, 1, 1)
    assert off["DP dense grad reduce-scatter"] == pytest.approx(rs)
    assert off["DP dense param all-gather"] == pytest.approx(ag)
    hidden = comm.dp_seconds(w, topo, 0, bwd_window=10.0, fwd_window=10.0)
    assert hidden["DP dense grad reduce-scatter"] == pytest.approx(rs / 4)
    assert hidden["DP dense param all-gather"] == pytest.approx(ag / 4)
    short = comm.dp_seconds(w, topo, 0, bwd_window=rs / 2, fwd_window=0.0)
    assert short["DP dense grad reduce-scatter"] == pytest.approx(rs - rs / 2 * 3 / 4)
    assert short["DP dense param all-gather"] == pytest.approx(ag)


def test_expert_all_to_all_splits_by_topology() -> None:
    """EP 16 of consecutive ranks over nodes of 8: a rank has 7 of its 15 peers in its node, so 7/15 of what it
    sends goes over NVLink (100 GB/s) and 8/15 over the network (10 GB/s), at once: the network's share decides.
    Inside one node (EP 8) it is NVLink only.

    A DeepEP / HybridEP dispatch (`experts`, `topk` given) sends a token once per rank and once per remote node its
    experts reach, not once per expert. Top-8 of 16 experts over 2 nodes (8 experts each, one per rank): the other
    node is missed only when all 8 picks are local, 1 / C(16, 8); the per-expert copies it would have had are
    8 x 8/16 = 4, so the network carries (1 - 1/12870) / 4 of them. Top-2 of 16 experts on EP 8 in one node (2 per
    rank): a peer is reached unless both picks miss its 2 experts, 1 - C(14, 2) / C(16, 2) = 29/120; 7 peers against
    2 x 14/16 per-expert copies: 203/210 of the NVLink bytes."""
    topo = comm.Topology(8, Link(1e-5, 100e9), Link(2e-5, 10e9))
    sent = 150e6
    assert topo.intra_share(16, 1) == pytest.approx(7 / 15)
    assert topo.alltoall(16, 1, sent) == pytest.approx(2e-5 + max(7 / 15 * sent / 100e9, 8 / 15 * sent / 10e9))
    assert topo.alltoall(8, 1, sent) == pytest.approx(1e-5 + sent / 100e9)
    remote = (1 - 1 / 12870) / 4
    assert comm.hit_share(16, 8, 16, 8) == pytest.approx(remote)
    assert comm.hit_share(16, 8, 16, 1) == 1.0  # one expert per rank: nothing to share inside the node
    assert topo.alltoall(16, 1, sent, experts=16, topk=8) == pytest.approx(
        2e-5 + max(7 / 15 * sent / 100e9, 8 / 15 * sent * remote / 10e9)
    )
    assert comm.hit_share(16, 2, 8, 1) == pytest.approx(203 / 210)
    assert topo.alltoall(8, 1, sent, experts=16, topk=2) == pytest.approx(1e-5 + sent * 203 / 210 / 100e9)
    # megatron's alltoall dispatcher (no experts given) permutes first: every copy moves
    assert topo.alltoall(8, 1, sent) > topo.alltoall(8, 1, sent, experts=16, topk=2)
    # a ring that leaves the node runs at the node's network ports: 4 members x 10 GB/s, below NVLink's 100
    assert topo.ring(8, 2, 1e9) == pytest.approx(2e-5 + 1e9 * 7 / 8 / 40e9)
    assert topo.ring(4, 2, 1e9) == pytest.approx(1e-5 + 1e9 * 3 / 4 / 100e9)
    # ranks 8 apart (one per node): the plain per-GPU network rate
    assert topo.ring(4, 8, 1e9) == pytest.approx(2e-5 + 1e9 * 3 / 4 / 10e9)


def test_expert_overlap_needs_the_interleaved_schedule() -> None:
    """megatron's EP all-to-all overlap runs only with PP 1 or VPP: with PP 2 and no VPP the traffic is exposed."""
    moe = dataclasses.replace(MODEL, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=64)
    topo = comm.Topology(8, Link(0.0, 1e9), Link(0.0, 1e9))
    base = Workload(moe, seq=128, micro_batch=1, global_batch=8, ep=4, dp=4, pp=1, ep_overlap=True)
    ep = comm.layer_comm(dataclasses.replace(base, ep_overlap=False), topo, (0, 0)).fwd["EP"]
    wide = comm.EpWindows(ep, ep, ep, ep)  # every phase's compute longer than its traffic
    assert comm.layer_comm(base, topo, (0, 0), wide).fwd["EP"] == pytest.approx(0.0)
    piped = dataclasses.replace(base, pp=2, dp=2)
    assert comm.layer_comm(piped, topo, (0, 0), wide).fwd["EP"] == pytest.approx(ep)
    assert comm.layer_comm(dataclasses.replace(piped, vpp=2), topo, (0, 0), wide).fwd["EP"] == pytest.approx(0)


def test_expert_overlap_hides_each_phase_behind_its_own_compute() -> None:
    """megatron's EP A2A overlap (model_chunk_schedule_plan.py) runs a layer's forward of one micro-batch beside
    its backward of another in three phases: combine bwd under pre-dispatch fwd, both dispatches under the MLPs,
    combine fwd under pre-dispatch bwd. By hand, all-to-all a = 1 ms, overlap efficiency 1:
    pre fwd 0.4 ms, MLPs 3 ms, pre bwd 2 ms -> exposed (1 - 0.4) + max(0, 2 - 3) + max(0, 1 - 2) = 0.6 ms, where one
    window over the layer's 5.4 ms would hide all 4 ms. With the dispatcher holding s = 0.15 of the device, a phase
    within its window still costs s x its traffic: 0.6 + 0.15 x 2 + 0.15 x 1 = 1.05 ms."""
    win = comm.EpWindows(pre_fwd=0.4e-3, pre_bwd=2e-3, mlp_fwd=1e-3, mlp_bwd=2e-3)
    topo = comm.Topology(8, Link(0.0, 1e9), Link(0.0, 1e9))
    assert comm.ep_overlap_exposed(topo, 1e-3, win) == pytest.approx(0.6e-3)
    shared = dataclasses.replace(topo, dispatch_share=0.15)
    assert comm.ep_overlap_exposed(shared, 1e-3, win) == pytest.approx(0.6e-3 + 0.15 * 2e-3 + 0.15 * 1e-3)
    # a first phase only 0.05 ms past its window costs the shared device's 0.15 x 1 ms instead
    assert comm.ep_overlap_exposed(shared, 1e-3, dataclasses.replace(win, pre_fwd=0.95e-3)) == pytest.approx(
        3 * 0.15e-3 + 0.15 * 1e-3
    )
    # through layer_comm: the layer's four all-to-alls split evenly over forward and backward
    moe = dataclasses.replace(MODEL, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=64)
    w = Workload(moe, seq=128, micro_batch=1, global_batch=8, ep=4, dp=4, pp=1, ep_overlap=True)
    raw = comm.layer_comm(dataclasses.replace(w, ep_overlap=False), topo, (0, 0)).fwd["EP"]  # dispatch + combine
    a = raw / 2
    win = comm.EpWindows(pre_fwd=0.4 * a, pre_bwd=2 * a, mlp_fwd=a, mlp_bwd=2 * a)
    lc = comm.layer_comm(w, topo, (0, 0), win)
    assert lc.fwd["EP"] == lc.bwd["EP"] == pytest.approx(0.6 * a / 2)


def test_in_step_scales_multiply_gemms_attention_and_the_rest() -> None:
    """A calibrated CPU profile's in-step scales: the GEMMs' seconds times `gemm_scale`, attention's times
    `attention_scale`, the memory-bound work's (here 1 GB/s) times `work_scale`, each exactly: a step of only GEMMs
    is 1.6x as long, one of GEMMs, attention and memory traffic 1.6 G + 1.3 A + 2.5 R."""
    w = Workload(MODEL, seq=128, micro_batch=2, global_batch=4, precision="fp32", attention="local")
    scaled = {"gemm_scale": 1.6, "attention_scale": 1.3, "work_scale": 2.5}
    base = only_gemms()
    gemms = step_time(w, base).total
    assert step_time(w, dataclasses.replace(base, **scaled)).total == pytest.approx(1.6 * gemms, rel=1e-9)
    memory = dataclasses.replace(base, memory_bandwidth=1e9)  # attention still free
    r = step_time(w, memory).total - gemms
    # megatron's local attention: FLOPs at 1 TFLOP/s and its scores' traffic over the memory bandwidth (attention's)
    full = dataclasses.replace(memory, attention={"local": AttentionCurve(1e12, 0.0, 2.0, False, 12.0)})
    a = step_time(w, full).total - gemms - r
    assert a > 0.05 * gemms and r > 0.1 * gemms  # each a real share of this step
    total = step_time(w, dataclasses.replace(full, **scaled)).total
    assert total == pytest.approx(1.6 * gemms + 1.3 * a + 2.5 * r, rel=1e-9)


def test_interleaved_p2p_runs_behind_each_chunks_compute() -> None:
    """PP 2: under 1F1B every activation send is on the critical path (2 per micro-batch and chunk); under the
    interleaved schedule (the trainer's overlap_p2p_comm, a GPU's non-serial host) a send is exposed only by what the
    overlap share of its chunk's forward (backward) cannot hide: here the chunks' compute hides all of it."""
    gpu = dataclasses.replace(
        only_gemms(1e9), kind="gpu", host=Host(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, serial=False),
        intra=Link(1e-6, 1e12), inter=Link(1e-6, 1e12), overlap_efficiency=1.0,
    )  # fmt: skip
    base = Workload(MODEL, seq=128, micro_batch=2, global_batch=16, pp=2, precision="fp32", attention="sdpa")
    blocking = step_time(base, gpu, ranks_per_node=2)
    p2p = comm.pp_seconds(base, comm.Topology.of(gpu, 2))
    assert blocking.stages[0].terms["PP p2p"] == pytest.approx(2 * p2p, rel=1e-9)
    interleaved = step_time(dataclasses.replace(base, vpp=2), gpu, ranks_per_node=2)
    assert "PP p2p" not in interleaved.terms  # hidden: 0 exposed seconds
    assert interleaved.stages[0].terms["PP p2p"] == 0.0
