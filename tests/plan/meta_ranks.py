"""Build every pipeline stage's model chunks on the meta device under a fake process group of the full world size,
and print what megatron built as JSON: the parameters (name, numel, expert, shared_embedding) and megatron's own
distributed-optimizer buffer layout (DistributedOptimizer.compute_full_param_layout), with the real elements each
data-parallel rank's optimizer shard covers.

    python tests/plan/meta_ranks.py PRESET GATE WORLD TP PP VPP EP [distopt]

No processes but this one: torch's fake backend answers every collective; megatron's gloo groups are not created.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


def main(argv: list[str]) -> None:
    preset, gate_name, world, tp, pp, vpp, ep = argv[:7]
    world, tp, pp, ep = int(world), int(tp), int(pp), int(ep)
    vpp = int(vpp) or None
    distopt = (argv[7] if len(argv) > 7 else "1") == "1"
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import group_params_for_buffers
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megagate.distributed import megatron_cpu
    from megagate.model import gate as gates
    from megagate.model.build import build_gpt_model, transformer_config
    from megagate.model.model_config import ParallelConfig
    from megagate.model.presets import model_preset

    megatron_cpu.install()
    # tied embeddings across stages: megatron all-reduces the embedding copy at construction; meta tensors have no
    # kernel for it (the fake backend answers nothing on meta), and the sum changes no size
    dist.all_reduce = lambda *args, **kwargs: None
    model = model_preset(preset, gate=gates.preset(gate_name))
    parallel = ParallelConfig(tp, pp, vpp, ep, 1)  # SP changes no parameter (and torch norms refuse it)
    stages = []
    for pp_rank in range(pp):
        rank = pp_rank * (world // pp)  # megatron's order tp-cp-ep-dp-pp: PP outermost
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            expert_model_parallel_size=ep,
            create_gloo_process_groups=False,
        )
        assert ps.get_pipeline_model_parallel_rank() == pp_rank
        cfg = transformer_config(
            model, parallel, params_dtype=torch.bfloat16, use_cpu=True, perform_initialization=False
        )
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distopt)
        dp = ps.get_data_parallel_world_size(with_context_parallel=True)
        edp = ps.get_expert_data_parallel_world_size()
        chunks = []
        for chunk in range(vpp or 1):
            stage = chunk if vpp else None
            with torch.device("meta"):
                gpt = build_gpt_model(
                    model,
                    cfg,
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                    vp_stage=stage,
                )
            params = [
                [
                    n,
                    p.numel(),
                    not getattr(p, "allreduce", True),
                    bool(getattr(p, "shared_embedding", False)),
                    str(p.dtype),
                ]
                for n, p in gpt.named_parameters()
            ]
            all_params = [p for p in gpt.parameters() if p.requires_grad]
            buffers = []
            if distopt:
                full = DistributedOptimizer.compute_full_param_layout(
                    all_params, None, dp, ddp, expert_data_parallel_world_size=edp
                )
                items = full.layouts.items()
            else:
                items = []
            for key, layout in items:
                size = dp if not key.is_expert_parallel else edp
                owned = []
                for r in range(size):
                    total = 0
                    for start, end in layout.bucket_indices:
                        shard = (end - start) // size
                        lo, hi = start + r * shard, start + (r + 1) * shard
                        for s, e, _ in layout.param_index_map.values():
                            total += max(0, min(e, hi) - max(s, lo))
                    owned.append(total)
                buffers.append(
                    {
                        "expert": key.is_expert_parallel,
                        "fp32": key.param_dtype == torch.float32,
                        "numel": layout.bucket_indices[-1][1],
                        "buckets": [list(b) for b in layout.bucket_indices],
                        "owned": owned,
                    }
                )
            groups = group_params_for_buffers(all_params, True)
            chunks.append({"params": params, "buffers": buffers, "groups": len(groups)})
        stages.append({"pp_rank": pp_rank, "dp": dp, "expert_dp": edp, "chunks": chunks})
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    print("JSON:" + json.dumps(stages))


if __name__ == "__main__":
    main(sys.argv[1:])
