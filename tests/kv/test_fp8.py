"""fp8 (e4m3) KV storage: its codec's own properties. Everything every quantised format must do (reads
equal to dequantise-then-reference, the engine's batching and preemption, bytes against the planner,
the flags) is tested for every codec of `kv.quant.CODECS`, fp8 among them."""

from __future__ import annotations

import torch

from gptoss_lite.cli import main
from gptoss_lite.kv.quant import CODECS, QuantSpec, dequantize_keys, dequantize_values, quantize_keys, quantize_values


def _spec() -> QuantSpec:
    return QuantSpec("fp8", key_group=4, value_group=8, residual=0)


def test_fp8_codes_are_within_a_sixteenth_of_their_distance_from_the_midpoint():
    """e4m3 keeps 3 mantissa bits: a value reads back within 1/16 of its distance from its group's
    midpoint (plus the float16 rounding of scale and midpoint), where int8's error is a fixed step."""
    torch.manual_seed(0)
    spec = _spec()
    x = torch.randn(1, 2, 8, 16) * 3
    codes, scale, zero = quantize_keys(x, spec)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and scale.shape == (1, 2, 2, 16)
    k = dequantize_keys(codes, scale, zero, spec, torch.float32)
    mid = zero.float().repeat_interleave(4, dim=2)
    assert ((k - x).abs() <= (x - mid).abs() / 16 + 2e-3 * x.abs().amax()).all()
    codes, scale, zero = quantize_values(x, spec)
    v = dequantize_values(codes, scale, zero, spec, torch.float32)
    mid = zero.float().repeat_interleave(8, dim=3)
    assert ((v - x).abs() <= (x - mid).abs() / 16 + 2e-3 * x.abs().amax()).all()
    assert (v - x).abs().max() > 0  # it really quantises


def test_fp8_saturates_and_keeps_a_constant_group_exact():
    """Large values saturate at e4m3's 448 steps from the midpoint instead of becoming NaN (e4m3 has no
    infinity), and a constant group reads back exactly."""
    spec = _spec()
    x = torch.tensor([3e4, -3e4, 1.0, 0.0] * 8).view(1, 1, 4, 8)
    out = dequantize_keys(*quantize_keys(x, spec), spec, torch.float32)
    assert torch.isfinite(out).all() and (out - x).abs().max() <= 3e4 / 16 + 64
    flat = torch.full((1, 1, 4, 8), -0.375)
    assert torch.equal(dequantize_values(*quantize_values(flat, spec), spec, torch.float32), flat)


def test_fp8_is_a_byte_a_code():
    assert CODECS["fp8"].bits == 8 and QuantSpec("fp8").bits == 8


def test_generate_takes_fp8_on_the_command_line(capsys):
    """`generate --kv-format fp8` labels its setting; with --compile it gets int8's one-line refusal
    (generate()'s compiled step reads the 16-bit mixed cache only)."""
    import json

    argv = ["generate", "hello", "--model", "lite-tiny", "--kv-format", "fp8", "--max-new-tokens", "3"]
    assert main([*argv, "--temperature", "0", "--json", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_setting"] == "fp8" and len(out["token_ids"]) == 3
    assert main([*argv, "--compile"]) == 2
    assert "--compile runs decode on the 16-bit mixed cache" in capsys.readouterr().err


def test_the_engine_on_fp8_blocks_equals_itself_compiled():
    """The engine with fp8 blocks gives the same tokens with compile_decode on (its all-decode steps then
    run compiled over the fp8 blocks; test_compiled_engine checks that in depth, with -m slow) as without."""
    from gptoss_lite.engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5] * 7, [9, 8, 7] * 5]
    outs = []
    for compile_decode in (False, True):
        llm = LLM("lite-tiny", kv_format="fp8", compile_decode=compile_decode)
        outs.append([r.token_ids for r in llm.generate(prompts, params)])
    assert outs[0] == outs[1] and all(len(t) == 6 for t in outs[0])
    assert llm.runner.compiled_steps > 0, "the compiled engine ran no compiled step"
