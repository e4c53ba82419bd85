"""`megagate export` / `megagate import` / `megagate analyze HF_DIR`: exact round trips through files, transformers'
own model classes loading and greedy-decoding an export, and one-line refusals.

HF -> megagate -> HF starts from folders written by transformers' own `save_pretrained` (random weights, every
tensor perturbed so that no norm is all ones or zeros); megagate -> HF -> megagate starts from a tiny trained
checkpoint (one trainer run per module) and from the imports. Everything but that one run is in-process.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from helpers import forked
from helpers import tiny_runs as T
from megagate.cli import main

# ~80 s of CPU in all (a trainer run, five HF round trips, transformers' greedy decoding); test-fast keeps the interop
# area through tests/interop/test_hf_layouts.py and test_hf_logits.py
pytestmark = pytest.mark.slow


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder's safetensors shards, read with safetensors itself."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def model_tensors(checkpoint: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a dist_checkpointing checkpoint (full), without megatron's _extra_state."""
    return {k: v for k, v in T.checkpoint_tensors(checkpoint, tmp).items() if "_extra_state" not in k}


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a[key], b[key]), (key, (a[key] - b[key]).abs().max())


def transformers_folder(model_cfg, fmt: str, folder: Path, seed: int = 0) -> Path:
    """An HF folder written by transformers' own class for `hf_config(model_cfg, fmt)`, random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megagate.interop import hf

    values = dict(hf.hf_config(model_cfg, fmt))
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # transformers' init leaves norms at 1 (or 0): perturb every tensor
            p.add_(torch.randn_like(p) * 0.05)
        for name, p in model.named_parameters():
            if "shared_expert_gate" in name:  # the zeros that stand for "no shared expert" (interop.hf_weights)
                p.zero_()
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _tiny(preset: str, gate: str, **overrides):
    from megagate.model import gate as gates
    from megagate.model.presets import model_preset

    return model_preset(preset, gate=gates.preset(gate), vocab_size=256, **overrides)


NEXT = dict(norm_zero_centered=True, rotary_percent=0.5)  # Qwen3-Next's (1 + w) norms and partial rotary
CASES = {
    "qwen3": lambda: _tiny("tiny", "baseline"),
    "qwen3-untied-1group": lambda: _tiny("tiny", "baseline", tie_embeddings=False, num_query_groups=1),
    "qwen3_moe": lambda: _tiny("tiny-moe", "baseline"),
    "qwen3_next": lambda: _tiny("tiny", "g1-elementwise", **NEXT),
    "qwen3_next-moe": lambda: _tiny("tiny-moe", "g1-elementwise", **NEXT),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_megagate_hf_is_identical(case, tmp_path, megatron_world):
    """transformers' save_pretrained -> import -> export: every safetensors tensor identical; and the imported
    checkpoint -> export -> import gives a bit-identical checkpoint (megagate -> HF -> megagate)."""
    from megagate.interop import hf
    from megagate.interop.hf_io import export_checkpoint, import_hf

    model_cfg = CASES[case]()
    fmt = hf.default_format(model_cfg)
    original = transformers_folder(model_cfg, fmt, tmp_path / "hf")
    import_hf(original, tmp_path / "ckpt_a", log=lambda m: None)
    export_checkpoint(tmp_path / "ckpt_a", tmp_path / "hf2", log=lambda m: None)
    assert_identical(hf_tensors(original), hf_tensors(tmp_path / "hf2"))
    import_hf(tmp_path / "hf2", tmp_path / "ckpt_b", log=lambda m: None)
    a = model_tensors(tmp_path / "ckpt_a" / "iter_0000000", tmp_path)
    b = model_tensors(tmp_path / "ckpt_b" / "iter_0000000", tmp_path)
    assert len(a) >= 8
    assert_identical(a, b)
    exported = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert exported["dtype"] == "float32"


# --- from a trained checkpoint -----------------------------------------------------------------------------------
TRAINED = ["model.norm_zero_centered=true", "model.rotary_percent=0.5"]  # a G1 run that Qwen3-Next holds


@pytest.fixture(scope="module")
def trained(tmp_path_factory, session_demo_dir) -> Path:
    """A tiny G1-elementwise run (4 steps) on the demo corpus: its newest checkpoint."""
    out = tmp_path_factory.mktemp("trained")
    T.run_train(out, session_demo_dir, *TRAINED, "train.train_steps=4", "train.warmup_steps=1")
    return out / "checkpoints" / "iter_0000004"


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory, megatron_world) -> Path:
    """The trained checkpoint exported in its default format (qwen3_next for G1 elementwise)."""
    from megagate.interop.hf_io import export_checkpoint

    out = tmp_path_factory.mktemp("exported") / "hf"
    export_checkpoint(trained, out, log=lambda m: None)
    return out


def test_trained_checkpoint_round_trip_is_bit_identical(trained, exported, tmp_path, megatron_world):
    from megagate.interop.hf_io import import_hf

    import_hf(exported, tmp_path / "back", log=lambda m: None)
    assert_identical(model_tensors(trained, tmp_path), model_tensors(tmp_path / "back" / "iter_0000000", tmp_path))
    meta = json.loads((exported / "megagate_export.json").read_text())
    assert meta["step"] == 4 and meta["format"] == "qwen3_next" and meta["variant"]["position"] == "g1"
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(hf_tensors(exported))


@pytest.mark.parametrize("gate", ["g1-elementwise", "g1-headwise"])
def test_paper_format_round_trip(gate, tmp_path, megatron_world):
    """The paper's released layout (gate rows inside q_proj per KV group; no transformers class holds it): a
    megatron-initialised checkpoint -> export --format paper -> import is bit-identical."""
    from megagate.interop.hf_io import export_checkpoint, import_hf, model_from_state, model_state, write_checkpoint

    model_cfg = _tiny("tiny", gate)
    write_checkpoint(
        model_from_state(model_cfg, model_state(_random_model(model_cfg))), model_cfg, tmp_path / "a", log=str
    )
    export_checkpoint(tmp_path / "a", tmp_path / "paper", "paper", log=str)
    config = json.loads((tmp_path / "paper" / "config.json").read_text())
    assert config[f"{gate[3:]}_attn_output_gate"] is True and config["model_type"] == "qwen3"
    import_hf(tmp_path / "paper", tmp_path / "b", log=str)
    a = model_tensors(tmp_path / "a" / "iter_0000000", tmp_path)
    assert len(a) >= 8
    assert_identical(a, model_tensors(tmp_path / "b" / "iter_0000000", tmp_path))


def test_sharding_and_bf16(trained, tmp_path, megatron_world):
    """--max-shard-size splits the weights over several shards (the index names each); --dtype bfloat16 rounds."""
    from megagate.interop.hf_io import export_checkpoint

    full = export_checkpoint(trained, tmp_path / "f32", max_shard_size="200KB", log=lambda m: None)
    shards = sorted(full.glob("model-*-of-*.safetensors"))
    weight_map = json.loads((full / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(shards) >= 3 and sorted(set(weight_map.values())) == [p.name for p in shards]
    for shard in shards:  # within the limit, or one tensor larger than it alone
        names = [k for k, v in weight_map.items() if v == shard.name]
        assert shard.stat().st_size <= 200_000 + 10_000 or len(names) == 1, (shard.name, names)
    bf16 = export_checkpoint(trained, tmp_path / "bf16", dtype="bfloat16", log=lambda m: None)
    a, b = hf_tensors(full), hf_tensors(bf16)
    assert sorted(a) == sorted(b) and all(b[k].dtype == torch.bfloat16 for k in b)
    assert all(torch.equal(a[k].to(torch.bfloat16), b[k]) for k in a)


def _megagate_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """argmax of megagate's forward over the whole sequence, recomputed from scratch at each step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens = torch.tensor([ids])
            position_ids = torch.arange(len(ids)).unsqueeze(0)
            logits = model(tokens, position_ids, None)  # [b, s, v]
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_transformers_loads_and_greedy_decodes_like_megagate(trained, exported, megatron_world):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megagate.commands.analyze import load_model_for_analysis

    model, encode = load_model_for_analysis(trained)
    text = "def read_file(path):\n    with open(path) as f:"
    tokenizer = AutoTokenizer.from_pretrained(exported)
    prompt = encode(text)
    assert tokenizer(text)["input_ids"] == prompt  # the exported tokenizer gives megagate's ids
    hf_model = AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(hf_model).__name__ == "Qwen3NextForCausalLM"
    with torch.no_grad():
        generated = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,  # the export's config.json has use_cache false (see megagate.interop.hf_io)
        )
    hf_tokens = generated[0, len(prompt) :].tolist()
    ours = _megagate_greedy(model, prompt, 8)
    print(f"greedy tokens: megagate {ours}, transformers {hf_tokens}")
    assert hf_tokens == ours
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt])).logits[0]
        mine = model(torch.tensor([prompt]), torch.arange(len(prompt)).unsqueeze(0), None)[0]
    diff = (theirs - mine).abs().max().item()
    print(f"max abs logit difference megagate vs transformers on the export: {diff:.3g}")
    assert diff < 1e-4


@pytest.mark.parametrize("case", ["qwen3", "qwen3_moe", "qwen3_next", "qwen3_next-moe"])
def test_greedy_tokens_of_random_models_match_transformers(case, tmp_path, megatron_world):
    """A trained tiny model repeats its most frequent token; random untied weights give varied argmaxes:
    transformers' greedy `generate` on the folder and megagate's greedy loop on its import agree token for token."""
    from transformers import AutoModelForCausalLM

    from megagate.commands.analyze import load_model_for_analysis
    from megagate.interop import hf
    from megagate.interop.hf_io import import_hf

    # untied: a tied random model's argmax is mostly the last token itself (its own embedding)
    model_cfg = dataclasses.replace(CASES[case](), tie_embeddings=False)
    folder = transformers_folder(model_cfg, hf.default_format(model_cfg), tmp_path / "hf", seed=1)
    import_hf(folder, tmp_path / "ck", log=str)
    model, _ = load_model_for_analysis(tmp_path / "ck", need_tokenizer=False)
    prompt = [3, 17, 99, 5, 42, 7]
    hf_model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        generated = hf_model.generate(
            # transformers' own save_pretrained folder keeps use_cache true, which its Qwen3-Next cache cannot do
            # without linear-attention layers: every step recomputes the whole sequence, as megagate's loop
            torch.tensor([prompt]),
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            use_cache=False,
        )
    hf_tokens = generated[0, len(prompt) :].tolist()
    ours = _megagate_greedy(model, prompt, 8)
    print(f"{case} greedy tokens: megagate {ours}, transformers {hf_tokens}")
    assert hf_tokens == ours and len(set(ours)) >= 3


def test_analyze_a_hf_folder_equals_analyze_of_the_checkpoint(trained, exported, tmp_path, megatron_world, capsys):
    """`megagate analyze HF_DIR` imports in memory: the same table as the checkpoint it was exported from."""
    assert main(["analyze", str(exported), "--out", str(tmp_path / "a_hf"), "--seq-len", "32", "--batch", "2"]) == 0
    assert main(["analyze", str(trained), "--out", str(tmp_path / "a_ck"), "--seq-len", "32", "--batch", "2"]) == 0
    hf_table = (tmp_path / "a_hf" / "table.txt").read_text()
    assert hf_table == (tmp_path / "a_ck" / "table.txt").read_text() and len(hf_table.splitlines()) >= 3
    assert not [p for p in exported.iterdir() if p.name.startswith(".")]  # nothing written into the HF folder


def test_eval_reads_an_import_like_its_source(trained, exported, tmp_path, megatron_world, session_demo_dir):
    """`megagate eval` on the import of an export gives the source checkpoint's perplexity, to the last digit."""
    from helpers.trainer_jobs import DEMO_BYTES, DEMO_VOCAB
    from megagate.data.demo import prepare_demo_data
    from megagate.interop.hf_io import import_hf

    import_hf(exported, tmp_path / "back", log=str)
    _, prefix = prepare_demo_data(session_demo_dir, DEMO_VOCAB, DEMO_BYTES)
    argv = ["eval", str(trained), str(tmp_path / "back"), "--data", prefix, "--seq-lengths", "32", "--samples", "4"]
    # its own process (eval opens its own megatron world)
    proc = forked.run_cli([*argv, "--out", str(tmp_path / "eval")], env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    source, imported = ([r["ppl"] for r in c["results"]] for c in results["checkpoints"])
    assert source == imported and 1 < source[0] < 2048, (source, imported)


# --- one-line refusals that need real folders ----------------------------------------------------------------------
def _refused(argv: list[str], capsys) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.splitlines()) == 1, (rc, err)
    return err


def test_refusals(trained, exported, tmp_path, megatron_world, capsys):
    from megagate.interop.hf_io import model_from_state, model_state, write_checkpoint

    # a variant no format holds (G2: a gate on the values) is refused naming it; nothing is written
    g2 = _tiny("tiny", "g2-elementwise")
    source = model_from_state(g2, model_state(_random_model(g2)))
    write_checkpoint(source, g2, tmp_path / "g2", log=lambda m: None)
    err = _refused(["export", str(tmp_path / "g2"), "--out", str(tmp_path / "out_g2")], capsys)
    assert "g2" in err and not (tmp_path / "out_g2").exists()
    # an existing non-empty --out
    err = _refused(["export", str(trained), "--out", str(exported)], capsys)
    assert str(exported) in err and "--force" in err
    # pickled .bin weights
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text((exported / "config.json").read_text())
    torch.save({"x": torch.zeros(1)}, bin_dir / "pytorch_model.bin")
    err = _refused(["import", str(bin_dir), "--out", str(tmp_path / "ck_bin")], capsys)
    assert "pytorch_model.bin" in err and not (tmp_path / "ck_bin").exists()
    # weights that do not fit config.json (another FFN width)
    bad = tmp_path / "shape"
    bad.mkdir()
    for p in exported.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    config = json.loads((exported / "config.json").read_text())
    config["intermediate_size"] = config["intermediate_size"] * 2
    (bad / "config.json").write_text(json.dumps(config))
    err = _refused(["import", str(bad), "--out", str(tmp_path / "ck_shape")], capsys)
    assert "shape" in err and not (tmp_path / "ck_shape").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def _random_model(model_cfg):
    """A megagate model of `model_cfg` with megatron's own random initialisation."""
    from megagate.distributed import megatron_cpu
    from megagate.model.build import build_gpt_model, transformer_config
    from megagate.model.model_config import ParallelConfig

    megatron_cpu.install()
    torch.manual_seed(0)
    tconfig = transformer_config(model_cfg, ParallelConfig(), params_dtype=torch.float32)
    return build_gpt_model(model_cfg, tconfig, backend="local")
