"""Checkpoints: native round trips, strict loading, HF layout mapping, MXFP4 (docs/checkpoints.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gptoss_lite.checkpoint import (
    DEFAULT_MODEL,
    INDEX_NAME,
    WEIGHTS_NAME,
    default_model_source,
    load_model,
    load_weights_into,
    save_model,
)
from gptoss_lite.fixtures import resolve_config
from gptoss_lite.model import GPTOSS


def _model(preset: str = "lite-tiny", seed: int = 0) -> GPTOSS:
    """A tiny model with non-trivial biases, norms and sinks (reset_parameters leaves them 0/1)."""
    model = GPTOSS(resolve_config(preset))
    model.reset_parameters(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name.rsplit(".", 1)[-1] or name.endswith("sinks") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.prepare_for_inference()  # as load_model leaves a model: same layout, same rounding


def _ids(T: int = 24, B: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 264, (B, T), generator=torch.Generator().manual_seed(seed))


def _snapshot(model: GPTOSS) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- native round trips -------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["lite-tiny", "gpt-oss-tiny"])
def test_native_round_trip_identical_logits(tmp_path, preset):
    """save_model -> load_model reproduces every tensor and the logits bit for bit, in eval mode."""
    model = _model(preset)
    save_model(model, tmp_path / "ck", extra_config={"tokenizer": "byte"})
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert config["format_version"] == 1 and config["tokenizer"] == "byte"
    assert config["model"] == model.config.to_dict()
    loaded = load_model(tmp_path / "ck")
    assert not loaded.training and loaded.config == model.config
    assert _same(_snapshot(model), _snapshot(loaded))
    ids = _ids()
    assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_tied_head_stored_once(tmp_path):
    """A tied head is not duplicated: the file holds exactly model.state_dict() (embed.weight only)."""
    model = _model("lite-tiny")
    save_model(model, tmp_path)
    stored = load_file(str(tmp_path / WEIGHTS_NAME))
    assert set(stored) == set(model.state_dict())
    assert not any(k.startswith("lm_head") for k in stored)


def test_sharded_round_trip(tmp_path):
    """Above the shard threshold the weights are split with an index json and load back identically."""
    model = _model("gpt-oss-tiny")
    save_model(model, tmp_path / "ck", max_shard_bytes=200_000)
    files = sorted(p.name for p in (tmp_path / "ck").iterdir())
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 2 and INDEX_NAME in files and WEIGHTS_NAME not in files
    index = json.loads((tmp_path / "ck" / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(model.state_dict()) and set(index["weight_map"].values()) == set(shards)
    ids = _ids()
    assert torch.equal(model(ids).logits, load_model(tmp_path / "ck")(ids).logits)
    # Re-saving unsharded replaces the shard set and keeps unrelated files.
    (tmp_path / "ck" / "tokenizer.json").write_text("{}")
    save_model(model, tmp_path / "ck")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["config.json", WEIGHTS_NAME, "tokenizer.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temp directories left behind


def test_save_is_atomic_on_failure(tmp_path, monkeypatch):
    """A save that fails midway leaves the previous checkpoint intact and no temp directory."""
    model = _model()
    save_model(model, tmp_path / "ck")
    before = (tmp_path / "ck" / WEIGHTS_NAME).read_bytes()
    import gptoss_lite.checkpoint.io as io

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(io, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_model(_model(seed=5), tmp_path / "ck")
    assert (tmp_path / "ck" / WEIGHTS_NAME).read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


def test_save_does_not_touch_model(tmp_path):
    """save_model leaves the model's tensors and training mode unchanged."""
    model = _model().train()
    before = _snapshot(model)
    save_model(model, tmp_path)
    assert model.training and _same(before, _snapshot(model))


def test_save_rejects_reserved_extra_keys(tmp_path):
    """extra_config cannot overwrite format_version or the model section."""
    with pytest.raises(ValueError, match="reserved"):
        save_model(_model(), tmp_path, extra_config={"model": {}})


def test_load_dtype_and_preset_seed():
    """A preset loads seeded random weights (with a warning), reproducibly, in the requested dtype."""
    with pytest.warns(UserWarning, match="RANDOM weights"):
        a = load_model("lite-tiny", seed=7, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="RANDOM weights"):
        b = load_model("lite-tiny", seed=7, dtype=torch.bfloat16)
    assert a.embed.weight.dtype == torch.bfloat16 and not a.training
    assert _same(_snapshot(a), _snapshot(b))


def test_load_weights_into_existing_model(tmp_path):
    """load_weights_into copies a checkpoint into a live model after validating it."""
    src, dst = _model(seed=1), _model(seed=2)
    save_model(src, tmp_path)
    load_weights_into(dst, tmp_path)
    assert _same(_snapshot(src), _snapshot(dst))


def test_default_model_source(capsys):
    """Without a trained demo model, the default source is the lite-tiny preset, announced on stderr."""
    source = default_model_source()
    if (DEFAULT_MODEL / "config.json").is_file():
        assert source == DEFAULT_MODEL
    else:
        assert source == "lite-tiny"
        assert "RANDOM weights" in capsys.readouterr().err


# ---- strict loading: every error names the problem, nothing half-loads ------------------------------


def _saved(tmp_path, preset="lite-tiny"):
    model = _model(preset)
    save_model(model, tmp_path)
    return model, load_file(str(tmp_path / WEIGHTS_NAME))


def _rewrite(tmp_path, tensors):
    save_file(tensors, str(tmp_path / WEIGHTS_NAME))


def test_missing_tensor_is_named(tmp_path):
    """A missing tensor is an error naming it and its expected shape."""
    _, tensors = _saved(tmp_path)
    del tensors["blocks.1.attn.sinks"]
    _rewrite(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"missing tensor blocks\.1\.attn\.sinks \(expected shape \[4\]\)"):
        load_model(tmp_path)


def test_unexpected_tensor_is_named(tmp_path):
    """An extra tensor (e.g. a duplicated tied head) is an error naming it."""
    _, tensors = _saved(tmp_path)
    tensors["lm_head.weight"] = tensors["embed.weight"].clone()
    _rewrite(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"unexpected tensor lm_head\.weight \(shape \[264, 64\]\)"):
        load_model(tmp_path)


def test_misshaped_tensor_names_both_shapes(tmp_path):
    """A mis-shaped tensor is an error naming it with the checkpoint's and the model's shapes."""
    _, tensors = _saved(tmp_path)
    tensors["blocks.0.moe.experts.up_proj"] = torch.zeros(4, 32, 64)
    _rewrite(tmp_path, tensors)
    with pytest.raises(
        ValueError,
        match=r"blocks\.0\.moe\.experts\.up_proj: shape \[4, 32, 64\] in checkpoint, "
        r"model expects \[4, 64, 64\]",
    ):
        load_model(tmp_path)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_tensor_is_named(tmp_path, bad):
    """A NaN or inf anywhere is an error naming the tensor."""
    _, tensors = _saved(tmp_path)
    tensors["norm.weight"][3] = bad
    _rewrite(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"tensor norm\.weight: 1 non-finite"):
        load_model(tmp_path)


def test_failed_load_into_leaves_model_untouched(tmp_path):
    """load_weights_into validates everything first: a bad checkpoint leaves the model as it was."""
    _, tensors = _saved(tmp_path)
    tensors["blocks.3.norm2.weight"][0] = float("nan")  # last tensor bad; earlier ones would copy fine
    _rewrite(tmp_path, tensors)
    target = _model(seed=9)
    before = _snapshot(target)
    with pytest.raises(ValueError, match=r"blocks\.3\.norm2\.weight"):
        load_weights_into(target, tmp_path)
    assert _same(before, _snapshot(target))


def test_load_weights_into_rejects_other_config(tmp_path):
    """Loading into a model with a different config is an error listing the differing fields."""
    save_model(_model("lite-tiny"), tmp_path)
    with pytest.raises(ValueError, match="config differs"):
        load_weights_into(_model("gpt-oss-tiny"), tmp_path)


def test_pickle_weights_refused(tmp_path):
    """A directory holding only pytorch_model.bin is refused by name (never unpickled)."""
    _saved(tmp_path)
    (tmp_path / WEIGHTS_NAME).unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*pickle"):
        load_model(tmp_path)


@pytest.mark.parametrize("payload", [b"", b"garbage" * 10, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}     "])
def test_corrupt_safetensors_refused(tmp_path, payload):
    """A model.safetensors that is not valid safetensors is a clear error naming the file."""
    _saved(tmp_path)
    (tmp_path / WEIGHTS_NAME).write_bytes(payload)
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        load_model(tmp_path)


def test_truncated_safetensors_refused(tmp_path):
    """A truncated weight file (e.g. an interrupted copy) is refused."""
    _saved(tmp_path)
    data = (tmp_path / WEIGHTS_NAME).read_bytes()
    (tmp_path / WEIGHTS_NAME).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_model(tmp_path)


def test_no_weights_and_no_config(tmp_path):
    """A directory without weights, or without config.json, is an error saying what is missing."""
    _saved(tmp_path)
    (tmp_path / WEIGHTS_NAME).unlink()
    with pytest.raises(ValueError, match=r"no model\.safetensors"):
        load_model(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_model(empty)


def test_shard_missing_from_index(tmp_path):
    """A sharded checkpoint whose shard file is gone, or disagrees with the index, is refused."""
    model = _model()
    save_model(model, tmp_path, max_shard_bytes=50_000)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / first).unlink()
    with pytest.raises(ValueError, match=f"shard {first} is missing"):
        load_model(tmp_path)
    save_model(model, tmp_path, max_shard_bytes=50_000)
    index["weight_map"]["embed.weight"] = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="disagree with"):
        load_model(tmp_path)


def test_unknown_source_lists_presets(tmp_path):
    """Neither a directory nor a preset: the error lists the valid preset names."""
    with pytest.raises(
        ValueError,
        match=r"neither a model directory nor a preset; valid presets: .*gptoss-lite-502m; test fixtures: .*lite-tiny",
    ):
        load_model("no-such-model")
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        load_model(tmp_path / "f.txt")


@pytest.mark.parametrize(
    "edit, exc, match",
    [
        (lambda c: c["model"].update(n_heads=3), ValueError, "n_heads=3 must be a multiple"),
        (lambda c: c["model"].update(d_model="64"), TypeError, "d_model='64': must be an int"),
        (lambda c: c["model"].update(wings=2), ValueError, r"unknown ModelConfig field\(s\) \['wings'\]"),
        (lambda c: c.update(format_version=99), ValueError, "format_version=99"),
        (lambda c: c.pop("model"), ValueError, "missing the 'model' section"),
        (lambda c: c.pop("format_version"), ValueError, "neither a gptoss-lite config"),
    ],
)
def test_malformed_config_is_named(tmp_path, edit, exc, match):
    """Bad config.json values are errors naming the file and the field."""
    _saved(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(exc, match=match):
        load_model(tmp_path)


def test_config_not_json(tmp_path):
    """A config.json that is not JSON is an error naming the file."""
    _saved(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        load_model(tmp_path)


# ---- HF layout (no transformers needed) ---------------------------------------------------------------

from gptoss_lite.checkpoint import (  # noqa: E402
    config_from_hf,
    config_to_hf,
    dequantize_mxfp4,
    hf_to_native,
    native_to_hf,
    quantize_mxfp4,
    save_hf,
)
from gptoss_lite.checkpoint.hf import hf_shapes  # noqa: E402

# gpt-oss-tiny with an original context whose YaRN ramp bounds transformers does not clamp.
HF_TINY = resolve_config("gpt-oss-tiny").replace(rope_original_context=256)


def _hf_model(seed: int = 0) -> GPTOSS:
    model = GPTOSS(HF_TINY)
    model.load_state_dict(_model("gpt-oss-tiny", seed).state_dict())
    return model.eval()


def test_hf_config_round_trip():
    """config_to_hf -> config_from_hf gives back the same ModelConfig, with truncate written as false."""
    hf = config_to_hf(HF_TINY)
    assert hf["rope_parameters"]["truncate"] is False and hf["rope_scaling"] == hf["rope_parameters"]
    assert hf["layer_types"][:2] == ["sliding_attention", "full_attention"]
    assert config_from_hf(hf) == HF_TINY


def test_hf_state_dict_mapping_is_exact():
    """native -> HF -> native is the identity; gate/up interleave by column, shapes as in docs/checkpoints.md."""
    model = _hf_model()
    native = model.state_dict()
    hf = native_to_hf(native, HF_TINY)
    assert {k: tuple(v.shape) for k, v in hf.items()} == hf_shapes(HF_TINY)
    gate_up = hf["model.layers.1.mlp.experts.gate_up_proj"]  # (E, C, 2I)
    assert torch.equal(gate_up[2, :, 0::2], native["blocks.1.moe.experts.gate_proj"][2].T)
    assert torch.equal(gate_up[2, :, 1::2], native["blocks.1.moe.experts.up_proj"][2].T)
    assert torch.equal(hf["model.layers.1.self_attn.v_proj.bias"], native["blocks.1.attn.kv_proj.bias"][32:])
    back = hf_to_native(hf, HF_TINY)
    assert _same(dict(native), back)


def test_save_hf_then_load_model(tmp_path):
    """save_hf writes an HF gpt-oss directory that load_model reads back to identical weights, held
    in the decode layout so that packing copies nothing, and the same logits (up to GEMM rounding,
    which depends on the layout)."""
    model = _hf_model()
    save_hf(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gpt_oss"
    loaded = load_model(tmp_path)
    want = model.state_dict()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, want[name]), name
    packed_on_load = ("q_proj", "kv_proj", "experts.")  # o_proj, router and head are re-stored by packing
    ptrs = {n: p.data_ptr() for n, p in loaded.named_parameters() if any(k in n for k in packed_on_load)}
    loaded.pack_for_decode()
    assert loaded.blocks[0].attn._packed_qkv() is not None
    assert {n: p.data_ptr() for n, p in loaded.named_parameters() if n in ptrs} == ptrs  # adopted, not copied
    ids = _ids()
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


def test_hf_load_names_hf_tensors(tmp_path):
    """A mis-shaped HF tensor is reported by its HF name with both shapes."""
    save_hf(_hf_model(), tmp_path)
    tensors = load_file(str(tmp_path / WEIGHTS_NAME))
    tensors["model.layers.2.mlp.experts.gate_up_proj"] = torch.zeros(4, 128, 64)
    _rewrite(tmp_path, tensors)
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.2\.mlp\.experts\.gate_up_proj: shape \[4, 128, 64\] "
        r"in checkpoint, model expects \[4, 64, 128\]",
    ):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(n_shared_experts=1), "n_shared_experts=1"),
        (dict(activation="swiglu"), "activation='swiglu'"),
        (dict(sink_clamp=(-10.0, 15.0)), "sink_clamp"),
        (dict(rope_pruned_pairs=2), "rope_pruned_pairs=2"),
    ],
)
def test_config_to_hf_refuses_lite_knobs(tmp_path, change, match):
    """Knobs HF gpt-oss cannot express are a ValueError, and save_hf writes nothing."""
    with pytest.raises(ValueError, match=match):
        config_to_hf(HF_TINY.replace(**change))
    model = GPTOSS(HF_TINY.replace(**change))
    with pytest.raises(ValueError, match=match):
        save_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_tiny_original_context_round_trips_through_hf_config():
    """YaRN with a ramp bound below 0 (original context 64) maps to HF and back unchanged."""
    cfg = HF_TINY.replace(rope_original_context=64)
    assert config_from_hf(config_to_hf(cfg)) == cfg


def test_lite_preset_refused_by_save_hf(tmp_path):
    """The GPT-OSS-Lite tiny preset (shared expert, SwiGLU, sink clamp, pruned RoPE) lists every refusal."""
    with pytest.raises(ValueError, match=r"n_shared_experts=1.*activation='swiglu'.*sink_clamp.*rope_pruned_pairs=4"):
        save_hf(_model("lite-tiny"), tmp_path)


def test_absent_biases_written_as_zeros():
    """A model without router/expert biases maps to HF with zero biases (an exact equivalent)."""
    cfg = HF_TINY.replace(router_bias=False, expert_bias=False, attention_bias=False)
    hf = native_to_hf(GPTOSS(cfg).state_dict(), cfg)
    assert not any(k.endswith("q_proj.bias") for k in hf)
    assert torch.count_nonzero(hf["model.layers.0.mlp.router.bias"]) == 0
    assert torch.count_nonzero(hf["model.layers.0.mlp.experts.gate_up_proj_bias"]) == 0


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda c: [d.pop("truncate") for d in (c["rope_parameters"], c["rope_scaling"])],
            "absent, which transformers reads as true",
        ),
        (lambda c: c.update(swiglu_alpha=1.5), "swiglu_alpha=1.5"),
        (lambda c: c.update(quantization_config={"quant_method": "fp8"}), "only MXFP4"),
        (lambda c: c.pop("num_experts_per_tok"), "lacks required key 'num_experts_per_tok'"),
        (lambda c: c.update(rope_scaling={**c["rope_scaling"], "rope_type": "longrope"}), "rope_type='longrope'"),
    ],
)
def test_config_from_hf_refuses_what_we_cannot_run(edit, match):
    """An HF config our model would run differently is a ValueError naming the key."""
    hf = config_to_hf(HF_TINY)
    edit(hf)
    with pytest.raises(ValueError, match=match):
        config_from_hf(hf)


# ---- MXFP4 ----------------------------------------------------------------------------------------------


def test_mxfp4_pack_unpack_exact():
    """Values of the form code·2^k (one k per 32-block) pack to MXFP4 and unpack exactly, low nibble first."""
    gen = torch.Generator().manual_seed(0)
    E, n_in, out = 3, 64, 5
    codes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    vals = codes[torch.randint(0, len(codes), (E, out, n_in // 32, 32), generator=gen)]
    vals[..., 0] = 6.0  # every block reaches the max code, so its scale is exactly 2^k
    k = torch.randint(-8, 8, (E, out, n_in // 32, 1), generator=gen).float()
    w = (vals * torch.exp2(k)).reshape(E, out, n_in).transpose(1, 2)  # (E, in, out)
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (E, out, n_in // 32, 16) and blocks.dtype == torch.uint8
    assert scales.shape == (E, out, n_in // 32) and torch.equal(scales.long(), k[..., 0].long() + 127)
    assert torch.equal(dequantize_mxfp4(blocks, scales), w)


def test_mxfp4_known_bytes():
    """One hand-built block: byte 0x2F is (even=-6 from 0xF, odd=+1 from 0x2); scale 128 doubles."""
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x2F
    out = dequantize_mxfp4(blocks, torch.full((1, 1, 1), 128, dtype=torch.uint8))  # (1, 32, 1)
    assert out.shape == (1, 32, 1)
    assert out[0, :3, 0].tolist() == [-12.0, 2.0, 0.0]


def test_mxfp4_checkpoint_loads_dequantised(tmp_path):
    """An HF directory with MXFP4 *_blocks/*_scales experts loads to the dequantised weights."""
    model = _hf_model()
    save_hf(model, tmp_path)
    tensors = load_file(str(tmp_path / WEIGHTS_NAME))
    expected = {}
    for name in [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        expected[name] = dequantize_mxfp4(blocks, scales)
    _rewrite(tmp_path, tensors)
    loaded = load_model(tmp_path, mxfp4="dequantize")
    hf = native_to_hf(loaded.state_dict(), HF_TINY)
    assert all(torch.equal(hf[k], v) for k, v in expected.items())
    # and an orphan scale tensor is refused by name
    tensors["model.layers.0.mlp.experts.extra_scales"] = scales.clone()
    _rewrite(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"scales without blocks: \['model\.layers\.0\.mlp\.experts\.extra_scales'\]"):
        load_model(tmp_path, mxfp4="dequantize")
    with pytest.raises(ValueError, match=r"unexpected tensor model\.layers\.0\.mlp\.experts\.extra_scales"):
        load_model(tmp_path)


def _mxfp4_dir(tmp_path, dtype=torch.float32):
    """An HF directory of HF_TINY with MXFP4 experts, as save_hf writes a packed model."""
    model = _hf_model().to(dtype).use_mxfp4_experts()
    save_hf(model, tmp_path)
    return model


def test_mxfp4_checkpoint_loads_packed_and_round_trips(tmp_path):
    """By default on a CPU the experts stay packed: the file's own codes, memory-mapped, equal logits."""
    from gptoss_lite.model.moe import MXFP4Experts

    model = _mxfp4_dir(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    packed = load_model(tmp_path)
    dense = load_model(tmp_path, mxfp4="dequantize")
    assert isinstance(packed.blocks[0].moe.experts, MXFP4Experts)
    assert not dense.mxfp4_experts
    for name, t in model.state_dict().items():
        assert torch.equal(packed.state_dict()[name], t), name
    ids = torch.randint(0, HF_TINY.vocab_size, (1, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (packed(ids).logits - dense(ids).logits).abs().max().item() <= 1e-4
    again = tmp_path / "again"
    save_hf(packed, again)  # packed out, packed in, byte for byte
    for name, t in load_file(str(again / WEIGHTS_NAME)).items():
        assert torch.equal(t, load_file(str(tmp_path / WEIGHTS_NAME))[name]), name


def test_mxfp4_int8_activations_at_load_and_on_the_command_line(tmp_path, capsys):
    from gptoss_lite.cli import main

    _mxfp4_dir(tmp_path)
    assert load_model(tmp_path).mxfp4_activations == "exact"
    assert load_model(tmp_path, mxfp4_activations="int8").mxfp4_activations == "int8"
    with pytest.raises(ValueError, match="needs packed experts; mxfp4='dequantize' has none"):
        load_model(tmp_path, mxfp4="dequantize", mxfp4_activations="int8")
    with pytest.raises(ValueError, match=r"mxfp4_activations='q8': must be one of \('exact', 'int8'\)"):
        load_model(tmp_path, mxfp4_activations="q8")
    args = ["generate", "x", "--model", str(tmp_path), "--max-new-tokens", "4", "--temperature", "0"]
    assert main([*args, "--mxfp4-activations", "int8"]) == 0
    capsys.readouterr()
    assert main(["generate", "x", "--mxfp4-activations", "int8"]) == 2  # the shipped model has no MXFP4 experts
    err = capsys.readouterr().err
    assert "apply to packed MXFP4 experts" in err and "Traceback" not in err


def test_mxfp4_bf16_dense_weights_stay_bf16(tmp_path):
    _mxfp4_dir(tmp_path, torch.bfloat16)
    model = load_model(tmp_path)
    assert model.embed.weight.dtype == torch.bfloat16
    assert model.blocks[0].moe.experts.gate_up_blocks.dtype == torch.uint8
    assert model.blocks[0].moe.experts.gate_up_bias.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda t: t.update({K + "down_proj_scales": t[K + "down_proj_scales"][:, :, :1].clone()}),
            r"tensor model\.layers\.1\.mlp\.experts\.down_proj_scales: shape \[4, 64, 1\] in checkpoint, "
            r"model expects \[4, 64, 2\]",
        ),
        (
            lambda t: t.update({K + "gate_up_proj_blocks": t[K + "gate_up_proj_blocks"].reshape(4, 128, 4, 8).clone()}),
            r"gate_up_proj_blocks: shape \[4, 128, 4, 8\] in checkpoint, model expects \[4, 128, 2, 16\]",
        ),
        (
            lambda t: t.update({K + "down_proj_blocks": t[K + "down_proj_blocks"].to(torch.int16)}),
            r"down_proj_blocks: dtype torch\.int16, expected uint8 MXFP4 codes",
        ),
        (
            lambda t: t[K + "down_proj_scales"].view(-1)[5:6].fill_(255),
            r"MXFP4 scales hold the NaN code 255: \['model\.layers\.1\.mlp\.experts\.down_proj_scales'\]",
        ),
        (lambda t: t.pop(K + "down_proj_scales"), r"missing tensor model\.layers\.1\.mlp\.experts\.down_proj_scales"),
    ],
)
def test_bad_mxfp4_tensors_are_one_clear_error(tmp_path, edit, match):
    _mxfp4_dir(tmp_path)
    tensors = load_file(str(tmp_path / WEIGHTS_NAME))
    edit(tensors)
    _rewrite(tmp_path, tensors)
    with pytest.raises(ValueError, match=match):
        load_model(tmp_path)


K = "model.layers.1.mlp.experts."


def test_truncated_shard_and_missing_index_entry_are_named(tmp_path):
    from gptoss_lite.checkpoint import INDEX_NAME

    model = _hf_model().use_mxfp4_experts()
    save_hf(model, tmp_path, max_shard_bytes=20_000)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    files = list(index["weight_map"].values())
    dropped = next(k for k, f in index["weight_map"].items() if files.count(f) > 1)
    del index["weight_map"][dropped]
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"in the file but not the index \['{re.escape(dropped)}'\]"):
        load_model(tmp_path)
    save_hf(model, tmp_path, max_shard_bytes=20_000)
    data = shards[-1].read_bytes()
    shards[-1].write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"{re.escape(shards[-1].name)}: not a readable safetensors file"):
        load_model(tmp_path)


def test_shipped_demo_model_is_the_default_and_runs():
    """The committed demo model loads strictly, records its training context, and generates."""
    from gptoss_lite.generation import generate

    assert default_model_source() == DEFAULT_MODEL
    model = load_model(DEFAULT_MODEL)
    assert model.config.train_context_length == 4096 and model.config.sliding_window == 128
    out = generate(model, torch.tensor([[256, 65, 66]]), 4, temperature=0)
    assert out.shape == (1, 7)


def test_shipped_model_is_stage_3a_read_at_yarn_64():
    """What docs/passkey.md#the-shipped-models-curve says the default is: models/lite-4k-pose-anchor's
    weights, byte for byte, and its config with the YaRN factor raised to 64 at load (the measured
    --rope-factor 64), nothing else changed."""
    import hashlib

    from gptoss_lite.config import ModelConfig

    trained = Path(__file__).resolve().parents[2] / "models" / "lite-4k-pose-anchor"
    digest = {d: hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for d in (trained, DEFAULT_MODEL)}
    assert digest[trained] == digest[DEFAULT_MODEL]

    def config(d):
        return ModelConfig.from_dict(json.loads((d / "config.json").read_text())["model"])

    assert config(DEFAULT_MODEL) == config(trained).with_rope_factor(64)
    assert config(DEFAULT_MODEL).rope_factor == 64 and config(trained).rope_factor == 32


def test_cli_bad_mxfp4_checkpoint_is_one_line(tmp_path, capsys):
    """`generate --model DIR` of an MXFP4 checkpoint with mis-shaped scales: one line naming the tensor."""
    from gptoss_lite.cli import main

    _mxfp4_dir(tmp_path)
    tensors = load_file(str(tmp_path / WEIGHTS_NAME))
    tensors[K + "down_proj_scales"] = tensors[K + "down_proj_scales"][:, :, :1].clone()
    _rewrite(tmp_path, tensors)
    assert main(["generate", "x", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "down_proj_scales: shape [4, 64, 1]" in err and "Traceback" not in err
