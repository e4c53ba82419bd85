"""Device profiles: the JSON file round-trips, a bad file is refused in one line naming what is wrong, the curve fits
recover known parameters, and a CPU profile plans a CPU run (plan --profile, --json)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from helpers.plan_profiles import cpu_profile
from megagate import config_reader
from megagate.errors import ConfigError
from megagate.plan import curves, plan
from megagate.plan import profile as profile_mod
from megagate.plan.profile import AttentionCurve, Curve


def test_round_trip(tmp_path) -> None:
    p = cpu_profile()
    profile_mod.save(p, str(tmp_path / "p.json"))
    assert profile_mod.load(str(tmp_path / "p.json")) == p
    assert [f.name for f in tmp_path.iterdir()] == ["p.json"]  # written by rename: no temporary left


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda d: d.update(schema=0), "schema 0"),
        (lambda d: d.update(kind="tpu"), "kind='tpu'"),
        (lambda d: d["gemm"]["fp32"].update(rate=float("nan")), "gemm.fp32.rate=nan"),
        (lambda d: d["gemm"].update(fp16=d["gemm"]["fp32"]), "gemm must have curves"),
        (lambda d: d["host"].update(per_layer=-1), "host.per_layer=-1"),
        (lambda d: d["host"].update(per_lunch=1), "host.per_lunch is not a known key"),
        (lambda d: d.pop("memory_bandwidth"), "memory_bandwidth is missing"),
        (lambda d: d["local_ranks"].update({"2": {"compute": 0}}), "local_ranks"),
        (lambda d: d.update(gemm_scale=0), "gemm_scale=0"),
    ],
)
def test_bad_profiles_are_one_line(tmp_path, mutate, words) -> None:
    data = profile_mod.to_dict(cpu_profile())
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as e:
        profile_mod.load(str(path))
    assert words in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_fits_recover_known_curves() -> None:
    truth = Curve(30e9, 32.0, 7e-6)
    shapes = [(m, n, k) for m in (4, 32, 256, 2048) for n in (64, 512) for k in (64, 1024)]
    fitted, err = curves.fit_gemm([(m, n, k, truth.seconds(m, n, k)) for m, n, k in shapes])
    assert fitted.half == 32.0 and err < 1e-6
    assert fitted.rate == pytest.approx(30e9, rel=1e-6) and fitted.latency == pytest.approx(7e-6, rel=1e-6)
    link, err = curves.fit_link([(b, 1e-4 + b / 3e9) for b in (4e3, 6e4, 1e6, 4e6)])
    assert link.latency == pytest.approx(1e-4, rel=1e-6) and link.bandwidth == pytest.approx(3e9, rel=1e-6)
    att = AttentionCurve(5e9, 2e-5, backward=2.5, causal_skip=False, score_bytes=12.0)
    shapes = [(1, h, s, d) for h in (2, 8) for s in (64, 256, 512) for d in (16, 64)]
    data = [(b, h, s, d, *att.seconds(b, h, s, s, d, True, 8e9)) for b, h, s, d in shapes]
    got, err = curves.fit_attention(data, 8e9, causal_skip=False, unfused=True)
    assert got.rate == pytest.approx(5e9, rel=1e-3) and got.score_bytes == pytest.approx(12.0, rel=1e-3)
    assert got.backward == pytest.approx(2.5, rel=1e-2)


def test_bandwidth_steps_smoothly_past_the_cache() -> None:
    """Tensors up to the cache at its rate; of a larger one the share beyond the cache at the memory's (4 MiB cache
    at 60 GB/s, memory 12 GB/s: of 8 MiB half at each rate, 20 GB/s in all); memory's rate without a cache."""
    p = dataclasses.replace(cpu_profile(), memory_bandwidth=12e9, cache_bandwidth=60e9, cache_bytes=4 << 20)
    assert p.bandwidth(1 << 20) == p.bandwidth(4 << 20) == 60e9
    assert p.bandwidth(8 << 20) == pytest.approx(20e9, rel=1e-12)  # 1 / (0.5 / 60 + 0.5 / 12) GB/s
    assert p.bandwidth(4 << 30) == pytest.approx(12.0094e9, rel=1e-5)  # 1/1024 cached: just above the memory's rate
    assert dataclasses.replace(p, cache_bandwidth=None).bandwidth(1 << 20) == 12e9


def test_cpu_profile_plans_the_cpu_run(tmp_path, capsys) -> None:
    """`plan --profile` with a CPU profile plans what megagate train runs there: local modules, SDPA attention,
    the trainer's overheads added to the work; --json carries per-stage memory, tokens/s per rank and cluster."""
    from megagate.commands import plan as command

    path = tmp_path / "cpu.json"
    profile_mod.save(cpu_profile(), str(path))
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_intermixed_args(
        [
            "examples/tiny_cpu.yaml",
            "--nodes",
            "1",
            "--gpus-per-node",
            "2",
            "--profile",
            str(path),
            "--json",
            "parallel.tensor_model_parallel_size=2",
        ]  # fmt: skip
    )
    assert command.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"]["kind"] == "cpu" and out["layout"]["tp"] == 2 and out["layout"]["attention"] == "sdpa"
    assert out["layout"]["kernels"] == "cpu-sdpa" and out["time"]["mfu"] is None
    t = out["time"]
    assert t["tokens_per_s_cluster"] == pytest.approx(t["tokens_per_s_per_gpu"] * 2)
    assert t["tokens_per_s_cluster"] == pytest.approx(t["tokens_per_step"] / t["step_s"])
    assert sum(t["terms_s"].values()) == pytest.approx(t["step_s"])
    assert t["terms_s"]["host overhead"] > 0 and t["terms_s"]["TP"] > 0
    assert len(out["memory"]["stages"]) == 1 and out["memory"]["stages"][0]["total_gb"] > 0
    # the two ranks share the machine: each at the measured share of one process's speed (compute 0.5: the GEMMs
    # take twice as long; host 0.8: the overheads 1 / 0.8 as long)
    cfg = config_reader.load("examples/tiny_cpu.yaml", ["parallel.tensor_model_parallel_size=2"], environment=False)
    p = cpu_profile()
    p = dataclasses.replace(p, gemm={k: dataclasses.replace(c, latency=0.0) for k, c in p.gemm.items()})
    shared = plan(cfg, 2, p, gpus_per_node=2).time.terms
    alone = plan(cfg, 2, dataclasses.replace(p, local_ranks={}), gpus_per_node=2).time.terms
    assert shared["GEMMs"] == pytest.approx(2 * alone["GEMMs"])
    assert shared["host overhead"] == pytest.approx(alone["host overhead"] / 0.8)


def test_gpu_plan_json_is_labelled(capsys) -> None:
    from megagate import cli

    assert cli.main(["plan", "slurm/examples/configs/15a2b_moe.yaml", "--nodes", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    t = out["time"]
    assert out["device"]["name"] == "h100-sxm" and out["world_size"] == 64 and out["fits"]
    assert t["tokens_per_s_cluster"] == pytest.approx(64 * t["tokens_per_s_per_gpu"])
    assert 0.1 < t["mfu"] < 0.5 and t["limiting"] in ("compute", "exposed communication", "host overhead")
    assert set(out) >= {"layout", "memory", "time", "assumptions", "refusal"}
    assert cli.main(["plan", "slurm/examples/configs/15a2b_moe.yaml", "--nodes", "8"]) == 0
    text = capsys.readouterr().out
    assert "tokens/s per GPU" in text and "tokens/s for the cluster of 64 GPUs" in text
