"""Muon (`train.optimizer: muon`, megatron-core's TensorParallelMuon) on megagate's fused attention.

The split test runs megatron's real optimizer on a real model's gradients and compares the update of linear_qkv
with Muon applied to the q, k, v and gate matrices separately (rows named by the layout, Newton-Schulz from
emerging-optimizers itself); the trainer tests train the tiny G1 model at TP 1 and TP 2 and resume it."""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_runs as T
from megagate.model import gate as gates
from megagate.model.build import build_gpt_model, transformer_config
from megagate.model.presets import model_preset
from megagate.model.qkv_layout import qkv_layout

emerging = pytest.importorskip("emerging_optimizers")
LR = 0.02
# fp32 products in Newton-Schulz: at megatron's default "medium" a CPU with avx512_bf16 / AMX runs bf16 kernels,
# whose rounding (~1e-3 on the update) would hide a wrong split as well as a right one at these tolerances
PRECISION = "highest"


def _muon_step(variant: str, groups: int, tag: bool) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """One Muon step of megatron's optimizer on a tiny gated model: (model config, linear_qkv's gradient, its
    update) of layer 1."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megagate.train.muon import tag_fused_qkv

    torch.manual_seed(0)
    model = model_preset("tiny", gate=gates.preset(variant), num_query_groups=groups)
    gpt = build_gpt_model(model, transformer_config(model))
    ddp = DistributedDataParallel(
        gpt.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False), gpt
    )
    config = OptimizerConfig(
        optimizer="muon",
        lr=LR,
        weight_decay=0.0,
        clip_grad=0.0,
        muon_split_qkv=True,
        muon_tp_mode="duplicated",
        muon_fp32_matmul_prec=PRECISION,
    )
    optimizer = get_megatron_optimizer(config, [ddp])
    if tag:
        assert tag_fused_qkv([ddp]) == model.num_layers
    tokens = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    position = torch.arange(16).unsqueeze(0).expand(2, -1)
    loss = ddp(tokens, position, None, labels=tokens.roll(-1, 1)).float().mean()
    loss.backward()
    ddp.finish_grad_sync()
    weight = gpt.decoder.layers[1].self_attention.linear_qkv.weight
    before, grad = weight.detach().clone(), weight.main_grad.detach().clone()
    optimizer.step()
    return model, grad, weight.detach() - before


def _separate_muon(model, grad: torch.Tensor) -> torch.Tensor:
    """Muon's update applied to each of q, k, v and the gate rows as its own matrix, rows named by the layout."""
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz
    from emerging_optimizers.utils import fp32_matmul_precision

    keys = qkv_layout(model.gate, model.num_attention_heads, model.num_query_groups, model.head_dim).row_keys()
    update = torch.zeros_like(grad)
    for name in sorted({k[0] for k in keys}):
        rows = torch.tensor([i for i, k in enumerate(keys) if k[0] == name])
        matrix = grad[rows]
        with fp32_matmul_precision(PRECISION):
            orth = newton_schulz(matrix, steps=5, coefficient_type="quintic")
        update[rows] = -LR * orth * max(matrix.shape) ** 0.5  # megatron's default "spectral" scale
    return update


@pytest.mark.parametrize(
    "variant, groups",
    [("g1-elementwise", 2), ("g1-elementwise", 4), ("g1-headwise", 2), ("g2-headwise", 2), ("g4-elementwise", 1)],
)
def test_the_fused_update_is_muon_on_q_k_v_and_gate_separately(megatron_world, variant, groups):
    model, grad, update = _muon_step(variant, groups, tag=True)
    expected = _separate_muon(model, grad)
    assert expected.abs().max() > 1e-3
    torch.testing.assert_close(update, expected, atol=2e-6, rtol=1e-4)


def test_megatrons_own_guess_splits_the_g1_rows_wrongly(megatron_world):
    """Without megagate's split, megatron derives [q, k, v] from the model config; tiny G1's 96 rows per group are
    a multiple of its 64, so it splits at the wrong rows silently: the update is not Muon on q, k, v, gate."""
    model, grad, update = _muon_step("g1-elementwise", 2, tag=False)
    expected = _separate_muon(model, grad)
    assert (update - expected).abs().max() > 0.1 * expected.abs().max()


@pytest.mark.distributed
def test_muon_trains_at_tp2_as_at_tp1_and_resumes_bit_identically(tmp_path, session_demo_dir):
    demo_dir = session_demo_dir
    muon = [
        "train.optimizer=muon",
        "train.use_distributed_optimizer=false",
        "train.lr=0.01",
        f"train.muon_matmul_precision={PRECISION}",
    ]
    T.run_train(tmp_path / "tp1", demo_dir, *muon)
    T.run_train(tmp_path / "tp2", demo_dir, *muon, "parallel.tensor_model_parallel_size=2", nproc=2)
    tp1, tp2 = T.losses(tmp_path / "tp1"), T.losses(tmp_path / "tp2")
    assert sorted(tp1) == list(range(1, 13)) and tp1[12] < tp1[1] - 0.3, tp1
    for step in tp1:
        assert abs(tp1[step] - tp2[step]) < 2e-4, (step, tp1[step], tp2[step])
    # stop at 6, resume: Muon's momentum comes back with the checkpoint
    T.run_train(tmp_path / "resumed", demo_dir, *muon, "train.exit_after_steps=6")
    T.run_train(tmp_path / "resumed", demo_dir, *muon)
    resumed = T.losses(tmp_path / "resumed")
    assert [resumed[s] for s in range(7, 13)] == [tp1[s] for s in range(7, 13)]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.optimizer=sgd"], "train.optimizer='sgd' is not one of adamw, muon"),
        (["train.optimizer=muon"], "train.optimizer='muon' with train.use_distributed_optimizer=true"),
        (
            [
                "train.optimizer=muon",
                "train.use_distributed_optimizer=false",
                "model.num_query_groups=1",
                "parallel.tensor_model_parallel_size=2",
            ],
            "model.num_query_groups (1) < parallel.tensor_model_parallel_size (2)",
        ),
        (
            ["train.optimizer=muon", "train.use_distributed_optimizer=false", "train.muon_tp_mode=shard"],
            "train.muon_tp_mode='shard' is not one of duplicated, blockwise, distributed",
        ),
        (
            ["train.optimizer=muon", "train.use_distributed_optimizer=false", "train.muon_matmul_precision=tf32"],
            "train.muon_matmul_precision='tf32' is not one of medium, high, highest",
        ),
        (
            ["train.optimizer=muon", "train.use_distributed_optimizer=false", "train.muon_momentum=1.0"],
            "train.muon_momentum=1.0 must be in [0, 1)",
        ),
    ],
)
def test_refusals_are_one_line(overrides, message):
    from megagate.config_reader import load
    from megagate.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load(str(T.CONFIG), [*overrides, "data.mock=true"])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bf16_muon_saves_and_resumes(tmp_path, session_demo_dir):
    """bf16 with the non-distributed optimizer (which Muon needs): megatron's mixed-precision optimizer checkpoints
    only half-precision parameters, so every norm must be bf16 too (model_factory casts megatron's fp32 local
    norms, as Megatron-LM's Float16Module does); before that the first save stopped the run."""
    bf16 = [
        "train.optimizer=muon",
        "train.use_distributed_optimizer=false",
        "train.precision=bf16",
        "train.train_steps=4",
        "train.warmup_steps=1",
    ]
    T.run_train(tmp_path / "whole", session_demo_dir, *bf16)
    T.run_train(tmp_path / "resumed", session_demo_dir, *bf16, "train.exit_after_steps=2")
    T.run_train(tmp_path / "resumed", session_demo_dir, *bf16)
    whole, resumed = T.losses(tmp_path / "whole"), T.losses(tmp_path / "resumed")
    assert sorted(whole) == [1, 2, 3, 4] and [resumed[s] for s in (3, 4)] == [whole[s] for s in (3, 4)]
