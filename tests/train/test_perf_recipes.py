"""NVIDIA's recipe knobs as config keys: the pipeline split (uneven first/last stages, the embedding/loss split,
megatron's layout string), TP and EP communication overlap with delayed expert wgrad, the flex dispatcher's
backends, Megatron-FSDP, activation and optimizer offloading.

Each is asserted on the real megatron config built from it (TransformerConfig, DistributedDataParallelConfig,
OptimizerConfig: they construct here, on CPU, for a simulated GPU machine); the layer split against megatron's own
`get_num_layers_to_build` for every stage; the bad inputs of the issue through `megagate train --dry-run` (exit 2,
one line); a CPU run switches the GPU-only knobs off and says so in one line.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from megagate import config_reader as C
from megagate.cli import main
from megagate.distributed.layout import stage_layers
from megagate.errors import ConfigError
from megagate.machine import Machine
from megagate.model.model_config import ParallelConfig
from megagate.run_setup import resolve
from megagate.train import components as K

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "examples" / "tiny_cpu.yaml"
MOE = {"preset": "tiny", "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 64}
GPU_TE = Machine(gpu=True, te=True, apex=True, deep_ep=True)
CPU = Machine(gpu=False, te=False, apex=False)
NO_TE_KERNELS = {"moe_permute_fusion": False, "moe_router_fusion": False, "apply_rope_fusion": False}


def make(model: dict | None = None, **sections: dict):
    data = {"model": copy.deepcopy(model or MOE), "data": {"mock": True}, **copy.deepcopy(sections)}
    return C.from_dict(data, environment=False)


# --- the pipeline split: megagate's rules = megatron's build -------------------------------------------------------
SPLITS = [
    # (num_layers, parallel keys, layers per [pp rank][virtual stage])
    (94, dict(pp=8, vpp=4, embedding=True, loss=True), None),  # Qwen3-235B-A22B (Megatron-Bridge)
    (126, dict(pp=8, vpp=8, embedding=True, loss=True), None),  # Llama-3.1-405B: 128 over 64 virtual stages
    (94, dict(pp=4, first=22, last=24), ((22,), (24,), (24,), (24,))),
    (30, dict(pp=4, vpp=2, first=6, last=8), ((3, 3), (4, 4), (4, 4), (4, 4))),
    (6, dict(pp=2, vpp=2, layout="Et|tt|tt|tL"), ((1, 2), (2, 1))),
    (7, dict(pp=2, vpp=2, layout="E(tt|)*3,tL"), ((2, 2), (2, 1))),
]


def _parallel(pp: int, vpp=None, first=None, last=None, embedding=False, loss=False, layout=None) -> ParallelConfig:
    return ParallelConfig(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        account_for_embedding_in_pipeline_split=embedding,
        account_for_loss_in_pipeline_split=loss,
        pipeline_model_parallel_layout=layout,
    )


@pytest.mark.parametrize("num_layers, keys, expected", SPLITS)
def test_stage_layers_are_megatrons(num_layers, keys, expected):
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    from megagate.model.build import transformer_config
    from megagate.model.presets import model_preset

    parallel = _parallel(**keys)
    grid = stage_layers(parallel, num_layers)
    assert sum(map(sum, grid)) == num_layers
    if expected is not None:
        assert grid == expected
    model = model_preset("tiny", num_layers=num_layers)
    config = transformer_config(model, parallel, use_cpu=True, perform_initialization=False)
    chunks = len(grid[0])
    for rank in range(parallel.pipeline_model_parallel_size):
        for v in range(chunks):
            stage = v if parallel.virtual_pipeline_model_parallel_size else None
            if config.pipeline_model_parallel_layout is not None:  # megatron's parsed [pp rank][virtual stage]
                built = config.pipeline_model_parallel_layout.layout[rank][v].count(LayerType.decoder)
            else:
                built = get_num_layers_to_build(config, vp_stage=stage, pp_rank=rank)
            assert built == grid[rank][v], (rank, v)


def test_qwen3_235b_split_has_the_embedding_and_loss_stages_one_layer_short():
    grid = stage_layers(_parallel(8, 4, embedding=True, loss=True), 94)
    assert grid[0] == (2, 3, 3, 3) and grid[7] == (3, 3, 3, 2) and all(row == (3,) * 4 for row in grid[1:7])


BAD_SPLITS = [
    (_parallel(2, 2, layout="Et|tt|tt|L"), 6, "places 5 decoder layers (t); model.num_layers is 6"),
    (_parallel(2, layout="Et|tt|tt|tL"), 6, "set parallel.virtual_pipeline_model_parallel_size=2 (it is None)"),
    (_parallel(2, 2, layout="Et|tx|tt|tL"), 6, "'x' is not a layer"),
    (_parallel(2, 2, layout="tt|Ett|tt|L"), 7, "the embedding E must open the first stage"),
    (_parallel(4, first=10, last=14), 24, "leave 0 of model.num_layers (24) for 2 other stages"),
    (_parallel(4, first=20, last=10), 24, "leave -6 of model.num_layers (24)"),
    (_parallel(4, first=6, last=5), 24, "leave 13 layers, not divisible by the 2 other stages x 1 virtual"),
    (_parallel(4, 2, first=5), 24, "num_layers_in_first_pipeline_stage (5) must be divisible by virtual"),
    (_parallel(4, first=4, embedding=True), 24, "cannot be combined with account_for_embedding"),
    (_parallel(4, layout="Et|t|t|tL", first=1), 4, "layout cannot be combined"),
    (_parallel(8, embedding=True), 94, "model.num_layers (94 + the embedding and/or loss counted as layers)"),
]


@pytest.mark.parametrize("parallel, num_layers, message", BAD_SPLITS)
def test_bad_splits_are_one_line_errors(parallel, num_layers, message):
    with pytest.raises(ConfigError) as err:
        stage_layers(parallel, num_layers)
    assert message in str(err.value) and "\n" not in str(err.value)


# --- the recipe knobs reach megatron -------------------------------------------------------------------------------
def _recipe_config(**perf):
    return make(
        parallel={
            "tensor_model_parallel_size": 2,
            "sequence_parallel": True,
            "expert_model_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
            "virtual_pipeline_model_parallel_size": 2,
            "num_layers_in_first_pipeline_stage": 2,
            "num_layers_in_last_pipeline_stage": 2,
        },
        model={**MOE, "num_layers": 4},
        train={"precision": "bf16", "global_batch_size": 16, "fp8_param_gather": False},
        perf={**NO_TE_KERNELS, **perf},
    )


def test_recipe_knobs_reach_transformer_ddp_and_optimizer_configs():
    cfg = _recipe_config(
        tp_comm_overlap=True,
        overlap_moe_expert_parallel_comm=True,
        delay_wgrad_compute=True,
        moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend="hybridep",
        offload_modules=["core_attn", "attn_proj"],
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads",
        use_precision_aware_optimizer=True,
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=0.5,
    )
    setup = resolve(cfg, None, GPU_TE)
    tc = setup.transformer_config()
    assert (tc.tp_comm_overlap, tc.overlap_moe_expert_parallel_comm, tc.delay_wgrad_compute) == (True, True, True)
    assert (tc.moe_token_dispatcher_type, tc.moe_flex_dispatcher_backend) == ("flex", "hybridep")
    assert tc.fine_grained_activation_offloading and tc.offload_modules == ["core_attn", "attn_proj"]
    assert (tc.num_layers_in_first_pipeline_stage, tc.num_layers_in_last_pipeline_stage) == (2, 2)
    ddp = K.ddp_config(setup)
    assert ddp.use_megatron_fsdp and ddp.data_parallel_sharding_strategy == "optim_grads"
    opt = K.optimizer_config(setup)
    assert opt.optimizer_cpu_offload and opt.optimizer_offload_fraction == 0.5
    lines = "\n".join(setup.describe())
    assert "perf recipe: TP comm overlap (userbuffers); EP all-to-all overlap; delayed expert wgrad; Megatron-FSDP" in (
        lines
    )
    assert "flex dispatcher backend hybridep" in lines


def test_layer_offloading_and_bf16_gradients_reach_megatron():
    """The recipes' layer-wise activation offloading (TransformerConfig.cpu_offloading*) and bf16 gradient
    reduction (DDP grad_reduce_in_fp32=False) as megatron builds them."""
    cfg = make(
        {**MOE, "num_layers": 4},
        train={"precision": "bf16", "global_batch_size": 16, "fp8_param_gather": False},
        perf={**NO_TE_KERNELS, "cpu_offloading_num_layers": 2, "grad_reduce_in_fp32": False},
    )
    setup = resolve(cfg, None, GPU_TE)
    tc = setup.transformer_config()
    assert tc.cpu_offloading and tc.cpu_offloading_num_layers == 2
    assert tc.cpu_offloading_activations and not tc.cpu_offloading_weights
    assert K.ddp_config(setup).grad_reduce_in_fp32 is False
    assert "activation offloading of 2 layers" in "\n".join(setup.describe())
    default = resolve(make({**MOE, "num_layers": 4}, perf=NO_TE_KERNELS), None, GPU_TE)
    assert not default.transformer_config().cpu_offloading and K.ddp_config(default).grad_reduce_in_fp32


def test_recipe_knobs_are_off_by_default_as_in_megatron():
    setup = resolve(_recipe_config(), None, GPU_TE)
    tc = setup.transformer_config()
    assert not (tc.tp_comm_overlap or tc.overlap_moe_expert_parallel_comm or tc.delay_wgrad_compute)
    assert not tc.fine_grained_activation_offloading and not K.ddp_config(setup).use_megatron_fsdp
    assert not K.optimizer_config(setup).optimizer_cpu_offload
    assert K.optimizer_config(setup).optimizer_offload_fraction == 0.0  # megatron's default, untouched


def test_the_cpu_switches_the_gpu_only_knobs_off_in_one_line():
    cfg = _recipe_config(
        tp_comm_overlap=True,
        overlap_moe_expert_parallel_comm=True,
        delay_wgrad_compute=True,
        offload_modules=["core_attn"],
        use_megatron_fsdp=True,
    )
    setup = resolve(cfg, None, CPU)
    line = setup.perf.cpu_line()
    for key in ("tp_comm_overlap", "overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "use_megatron_fsdp"):
        assert key in line
    assert "offload_modules" in line
    kwargs = setup.transformer_kwargs
    assert "tp_comm_overlap" not in kwargs and "overlap_moe_expert_parallel_comm" not in kwargs
    assert not K.ddp_config(setup).use_megatron_fsdp
    setup.transformer_config()  # megatron accepts the CPU's set-up: pipeline split included


# --- bad input: exit 2, one line -----------------------------------------------------------------------------------
BAD = [
    (
        ["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2"]
        + ["parallel.pipeline_model_parallel_layout=Et|t|t|L"],
        "parallel.pipeline_model_parallel_layout='Et|t|t|L' places 3 decoder layers (t); model.num_layers is 2",
    ),
    (
        ["parallel.pipeline_model_parallel_size=2", "parallel.num_layers_in_first_pipeline_stage=2"],
        "leave 0 of model.num_layers (2) for 1 other stages: every stage needs at least one layer",
    ),
    (
        ["perf.use_megatron_fsdp=true", "train.use_distributed_optimizer=false"],
        "perf.use_megatron_fsdp=true needs train.use_distributed_optimizer=true",
    ),
    (
        ["train.backend=local", "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
        + ["perf.tp_comm_overlap=true"],
        "perf.tp_comm_overlap=true needs Transformer Engine's userbuffers",
    ),
    (["perf.tp_comm_overlap=true"], "needs tensor_model_parallel_size > 1 and parallel.sequence_parallel=true"),
    (["perf.overlap_moe_expert_parallel_comm=true"], "needs a MoE model with parallel.expert_model_parallel_size > 1"),
    (["perf.delay_wgrad_compute=true"], "perf.delay_wgrad_compute=true needs perf.overlap_moe_expert_parallel_comm"),
    (["perf.offload_modules=[attn_proj]"], "'attn_proj' needs 'core_attn' too"),
    (["perf.offload_modules=[router]"], "perf.offload_modules[]"),
    (["perf.optimizer_cpu_offload=true"], "needs perf.use_precision_aware_optimizer=true"),
    (["perf.moe_flex_dispatcher_backend=nccl"], "perf.moe_flex_dispatcher_backend"),
    (
        ["perf.cpu_offloading_num_layers=9"],
        "perf.cpu_offloading_num_layers=9 must be an integer in [0, model.num_layers",
    ),
    (
        ["parallel.pipeline_model_parallel_size=2", "perf.cpu_offloading_num_layers=1"],
        "perf.cpu_offloading_num_layers=1 needs pipeline_model_parallel_size 1",
    ),
    (
        ["model.recompute_granularity=selective", "perf.cpu_offloading_num_layers=1"],
        "perf.cpu_offloading_num_layers=1 cannot run with model.recompute_granularity",
    ),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=[b[0][-1] for b in BAD])
def test_bad_recipe_inputs_exit_2_with_one_line(overrides, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", str(BASE), "--dry-run", "--world-size", "4", *overrides]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err, err
    assert list(tmp_path.iterdir()) == []


def test_an_uneven_split_dry_runs(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = [
        "model.num_layers=5",
        "parallel.pipeline_model_parallel_size=2",
        "parallel.virtual_pipeline_model_parallel_size=2",
        "parallel.pipeline_model_parallel_layout=Et|tt|t|tL",
    ]
    assert main(["train", "--config", str(BASE), "--dry-run", "--world-size", "2", *overrides]) == 0
    assert "PP 2" in capsys.readouterr().out


def test_placement_key_records_only_what_is_not_the_default():
    from megagate.distributed.layout import placement_key

    assert placement_key(ParallelConfig(pipeline_model_parallel_size=2), 4) == {}  # old checkpoints compare equal
    uneven = ParallelConfig(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1)
    assert placement_key(uneven, 4) == {"stages": [[1], [3]]}
    assert placement_key(ParallelConfig(expert_tensor_parallel_size=1), 4) == {"etp": 1}


@pytest.mark.slow
@pytest.mark.distributed
def test_a_dp_reshardable_resume_refuses_another_split(tmp_path, session_demo_dir):
    """The distributed optimizer's dp_reshardable shards follow the stages' layers: a resume under another uneven
    split is refused in one line naming the stages (a real PP 2 run, 1 + 2 layers, then 2 + 1)."""
    from tests.helpers import tiny_runs as T

    run = tmp_path / "run"
    split = ["model.num_layers=3", "parallel.pipeline_model_parallel_size=2"]
    T.run_train(run, session_demo_dir, *split, "parallel.num_layers_in_first_pipeline_stage=1",
                "train.exit_after_steps=2", nproc=2)  # fmt: skip
    refused = T.run_train(run, session_demo_dir, *split, "parallel.num_layers_in_first_pipeline_stage=2", nproc=2,
                          check=False)  # fmt: skip
    errors = [line for line in refused.stderr.splitlines() if "megagate train: error:" in line]
    assert refused.returncode != 0 and errors, refused.stderr[-3000:]
    assert "stages [[1], [2]] -> [[2], [1]]" in errors[0], errors
