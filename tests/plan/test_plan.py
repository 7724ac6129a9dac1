"""Serving arithmetic (gptoss_lite.plan): hand-derived values, FLOP identities and every validation rule."""

from __future__ import annotations

import ast
import math
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gptoss_lite import plan as P
from gptoss_lite.config import PRESETS, count_active_parameters, count_parameters
from gptoss_lite.kv import evict

LITE = P.GEOMETRY_PRESETS["gptoss-lite-502m"]
LITE_ALL_FULL = P.AttentionKVGeometry("lite-all-full", 12, 4, 96)


def _hw(**overrides):
    args = dict(
        weight_bytes=1000,
        bandwidth_bytes_per_second=1e12,
        peak_flops_per_second=1e15,
        parameter_count=500,
        device_capacity_bytes=10_000,
        runtime_reserve_bytes=0,
    )
    args.update(overrides)
    return P.ServingHardware(**args)


# ---- hand-derived payloads ----------------------------------------------------------------------------


def test_llama3_8b_bytes_per_token():
    """Llama-3-8B GQA (32 layers, 8 KV heads, D 128, BF16) stores 131,072 B = 128 KiB per token."""
    g = P.get_geometry("llama-3-8b")
    assert g.bytes_per_token == 131_072 == 128 * P.KIB


def test_llama33_70b_payload_at_128k_is_40_gib():
    """LLaMA-3.3-70B at 131,072 tokens holds exactly 40 GiB (42.95 GB) of KV."""
    payload = P.kv_payload_bytes(P.get_geometry("llama-3.3-70b"), 131_072)
    assert payload == 40 * P.GIB
    assert round(payload / P.GB, 2) == 42.95


def test_mha_70b_equivalent_is_8x_gqa():
    """The 70B MHA-equivalent (64 KV heads) stores 8x the KV of its 8-KV-head GQA sibling."""
    assert P.get_geometry("mha-70b-equivalent").bytes_per_token == 8 * P.get_geometry("llama-3.3-70b").bytes_per_token


def test_deepseek_v3_mla_bytes_per_token():
    """DeepSeek-V3 MLA: 61 x (512 + 64) x 2 B = 70,272 B per token, no factor of two."""
    assert P.get_geometry("deepseek-v3").bytes_per_token == 70_272
    assert P.kv_payload_bytes(P.get_geometry("deepseek-v3"), 10, batch_size=3) == 70_272 * 30


def test_lite_mixed_payload_at_128k():
    """502M at 131,072 tokens: 2.25 GiB all-full, 1.13 GiB mixed (docs/kv-cache.md#kv-arithmetic-of-the-502m-preset)."""
    assert P.kv_payload_bytes(LITE_ALL_FULL, 131_072) == 2_415_919_104
    assert P.kv_payload_bytes(LITE, 131_072) == 1_209_139_200
    assert round(2_415_919_104 / P.GIB, 2) == 2.25 and round(1_209_139_200 / P.GIB, 2) == 1.13


@pytest.mark.parametrize("tokens, ratio", [(4096, 1.94), (8192, 1.97), (32768, 1.99), (131072, 2.00)])
def test_lite_mixed_ratio(tokens, ratio):
    """The 502M mixed/all-full reduction matches docs/kv-cache.md#kv-arithmetic-of-the-502m-preset to two decimals."""
    got = P.kv_payload_bytes(LITE_ALL_FULL, tokens) / P.kv_payload_bytes(LITE, tokens)
    assert round(got, 2) == ratio


@given(st.integers(1, 128))
def test_mixed_ratio_is_one_inside_window(tokens):
    """At T <= W a sliding layer stores every token, so mixed and all-full payloads agree."""
    assert P.kv_payload_bytes(LITE, tokens) == P.kv_payload_bytes(LITE_ALL_FULL, tokens)


def test_gpt_oss_window_aware_presets():
    """gpt-oss-20b/120b: half the layers sliding with W=128; per-layer token bytes 2*8*64*2 = 2048."""
    g20, g120 = P.get_geometry("gpt-oss-20b"), P.get_geometry("gpt-oss-120b")
    assert P.kv_payload_bytes(g20, 1000) == 2048 * (12 * 1000 + 12 * 128)
    assert P.kv_payload_bytes(g120, 1000) == 2048 * (18 * 1000 + 18 * 128)
    assert g20.bytes_per_token == 24 * 2048


def test_kv_scale_exact_and_decimal():
    """kv_scale multiplies exactly: 0.5 halves, 0.1 is read as 1/10, Fraction is accepted."""
    g = P.get_geometry("llama-3-8b")
    assert P.kv_payload_bytes(g, 10, kv_scale=0.5) == 655_360
    assert P.kv_payload_bytes(g, 10, kv_scale=0.1) == 131_072
    assert P.kv_payload_bytes(g, 3, 2, kv_scale=Fraction(3, 16)) == 131_072 * 6 * 3 // 16


def test_zero_context_is_zero_payload():
    """An empty context holds no KV bytes."""
    assert P.kv_payload_bytes(LITE, 0) == 0


def test_model_presets_geometry_is_derived_from_config():
    """Our presets' geometries come from config.PRESETS: layers, KV heads, D, sliding count and window as specified."""
    expected = {
        "gptoss-lite-502m": (12, 4, 96, 6, 128),
        "gpt-oss-20b": (24, 8, 64, 12, 128),
        "gpt-oss-120b": (36, 8, 64, 18, 128),
    }
    for name, (layers, kv_heads, head_dim, sliding, window) in expected.items():
        g = P.GEOMETRY_PRESETS[name]
        assert (g.attention_layers, g.kv_heads, g.head_dim, g.sliding_layers, g.sliding_window) == (
            layers,
            kv_heads,
            head_dim,
            sliding,
            window,
        )
        assert g == P.geometry_from_model_config(PRESETS[name], name=name)
        assert g.full_layers == layers - sliding == len(PRESETS[name].full_layers)


def test_model_presets_weights_are_derived_from_parameter_counts():
    """Parameter counts come from count_parameters; active leaves out an untied embedding (near the published ones)."""
    lite = P.MODEL_WEIGHTS["gptoss-lite-502m"]
    assert (lite.total_parameters, lite.active_parameters) == (501_836_640, 247_032_672)  # tied: head counts
    for name, total, active, published in (
        ("gpt-oss-20b", 20_914_757_184, 3_608_307_264, (20.9e9, 3.6e9)),
        ("gpt-oss-120b", 116_829_156_672, 5_132_849_472, (116.8e9, 5.1e9)),
    ):
        w, cfg = P.MODEL_WEIGHTS[name], PRESETS[name]
        assert w.total_parameters == count_parameters(cfg) == total
        assert w.active_parameters == count_active_parameters(cfg) - cfg.vocab_size * cfg.d_model == active
        assert (w.query_heads, w.attention_head_dim) == (64, 64)
        assert abs(total / published[0] - 1) < 0.005 and abs(active / published[1] - 1) < 0.01


def test_geometry_from_hf_config():
    """An HF gpt-oss-20b config.json counts sliding layers from layer_types; head_dim falls back to C/H."""
    hf = {
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
    }
    g = P.geometry_from_hf_config(hf, name="gpt-oss-20b")
    assert g == P.GEOMETRY_PRESETS["gpt-oss-20b"]
    llama = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    assert P.geometry_from_hf_config(llama).bytes_per_token == 131_072


def _imports(module_path):
    """(module-level import roots, every import root) of a source file."""
    tree = ast.parse(module_path.read_text())

    def roots(nodes):
        return {
            (n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
            for n in nodes
            if isinstance(n, (ast.Import, ast.ImportFrom))
            for a in (n.names if isinstance(n, ast.Import) else n.names[:1])
        }

    return roots(tree.body), roots(ast.walk(tree))


def test_plan_and_evict_import_no_torch():
    """Importing plan and kv.evict (package included) loads no torch, and their source never imports it."""
    import subprocess
    import sys

    code = "import sys, gptoss_lite.plan, gptoss_lite.kv.evict; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    for module in (P, evict):
        assert "torch" not in _imports(Path(module.__file__))[1]


# ---- roofline, knee, capacity ---------------------------------------------------------------------------


def test_decode_ceiling_formula():
    """Aggregate ceiling = B * bandwidth / (W + KV(N, B)); per request is that / B."""
    g = P.get_geometry("llama-3-8b")
    hw = _hw(weight_bytes=16 * P.GB, bandwidth_bytes_per_second=2e12, device_capacity_bytes=80 * P.GB)
    c = P.decode_ceiling(hw, g, 1000, batch_size=4)
    assert c.kv_bytes == 131_072 * 1000 * 4
    assert c.total_bytes_per_step == 16 * P.GB + c.kv_bytes
    assert c.aggregate_tokens_per_second == pytest.approx(4 * 2e12 / c.total_bytes_per_step)
    assert c.per_request_tokens_per_second == pytest.approx(c.aggregate_tokens_per_second / 4)
    assert (c.batch_size, c.context_tokens) == (4, 1000)


def test_intensity_knee_and_capacity():
    """Intensity 2PB/bytes, knee W/KV(N,1), capacity (cap - W - reserve) // KV(N,1)."""
    g = P.MLAKVGeometry("toy", 1, 4, 1, 1)  # 5 B/token
    hw = _hw(weight_bytes=1000, parameter_count=500, device_capacity_bytes=10_000, runtime_reserve_bytes=1000)
    assert P.arithmetic_intensity(hw, g, 100, 2) == pytest.approx(2 * 500 * 2 / (1000 + 1000))
    assert P.batch_knee(hw, g, 100) == pytest.approx(2.0)
    assert P.max_resident_requests(hw, g, 100) == (10_000 - 1000 - 1000) // 500
    assert P.max_resident_requests(hw, g, 100, kv_scale=0.4) == 8000 // 200


def test_moe_hardware_streams_active_resides_total():
    """serving_hardware reads active weights per step but reserves total weights in memory."""
    hw = P.serving_hardware(P.get_hardware("a100-80gb"), P.MODEL_WEIGHTS["gptoss-lite-502m"])
    assert hw.weight_bytes == 2 * 247_032_672 and hw.resident_bytes == 2 * 501_836_640
    assert hw.parameter_count == 247_032_672
    assert hw.ridge_flops_per_byte == pytest.approx(312e12 / 2.039e12)
    two = P.serving_hardware(P.get_hardware("h200"), P.MODEL_WEIGHTS["gpt-oss-120b"], devices=2)
    assert two.device_capacity_bytes == 2 * 141 * P.GB and two.bandwidth_bytes_per_second == 2 * 4.8e12


def test_measure_this_machine_is_positive():
    """The measured host figures are finite and positive and labelled measured."""
    spec = P.measure_this_machine(copy_bytes=8 * P.MIB, repeats=2)
    assert spec.bandwidth_bytes_per_second > 1e8 and spec.peak_flops_per_second > 1e6
    assert spec.device_capacity_bytes > P.GIB / 4 and spec.source.startswith("measured")


# ---- FLOPs and cost -------------------------------------------------------------------------------------


def test_chunked_prefill_adds_up_and_later_chunks_cost_more():
    """16 chunks of 512 have exactly the attention FLOPs of one 8,192-token prefill; each costs more."""
    chunks = [P.attention_flops(12, 8, 96, 512, cached_prefix=512 * i) for i in range(16)]
    assert sum(chunks) == P.attention_flops(12, 8, 96, 8192)
    assert all(a < b for a, b in zip(chunks, chunks[1:]))
    prefills = [P.prefill_flops(1000, 12, 8, 96, 512, prefix=512 * i) for i in range(16)]
    assert sum(prefills) == P.prefill_flops(1000, 12, 8, 96, 8192)


def test_attention_flops_pairs():
    """One query after p cached keys sees p + 1 keys: 4 * L * H * D * (p + 1) FLOPs."""
    assert P.attention_flops(2, 3, 4, 1, cached_prefix=9) == 4 * 2 * 3 * 4 * 10
    assert P.attention_flops(1, 1, 1, 3) == 4 * 6


@given(st.integers(0, 300), st.integers(0, 300), st.integers(1, 64))
def test_windowed_attention_pairs_match_brute_force(queries, prefix, window):
    """With a window W each query at absolute position i sees min(W, i + 1) keys."""
    expected = 4 * sum(min(window, i + 1) for i in range(prefix, prefix + queries))
    assert P.attention_flops(1, 1, 1, queries, prefix, sliding_window=window) == expected


def test_decode_flops():
    """A decode step is B * (2P + attention of one query over `keys` keys); zero keys is weights only."""
    assert P.decode_flops(100, 2, 3, 4, keys=10, batch=5) == 5 * (200 + 4 * 2 * 3 * 4 * 10)
    assert P.decode_flops(100, 2, 3, 4, keys=0, batch=2) == 400


def test_prefill_floor_seconds():
    """Prefill floor = 2 P N / peak."""
    assert P.prefill_floor_seconds(1_000_000, 4096, 1e12) == pytest.approx(2 * 1e6 * 4096 / 1e12)


def test_cached_input_cost():
    """Prefix billing: baseline R(p+s); cached p(w + (R-1)r) + R s; warm ratio (p r + s)/(p + s)."""
    c = P.cached_input_cost(prefix=1000, suffix=100, requests=10)
    assert c.baseline == 11_000
    assert c.cached == pytest.approx(1000 * (1.25 + 9 * 0.1) + 1000)
    assert c.amortized_cost_factor == pytest.approx(11_000 / c.cached)
    assert c.warm_request_cost_ratio == pytest.approx((100 + 100) / 1100)


def test_amortized_cost_factor_course_example():
    """The factor is how many times cheaper cached input is (baseline / cached): > 1 when the prefix cache saves.

    Course example: prefix 7,680, suffix 512, 10 requests, read 0.1, write 1.25: baseline 81,920 tokens,
    cached 7,680 x (1.25 + 9 x 0.1) + 10 x 512 = 21,632 token-equivalents, factor 81,920 / 21,632 = 3.79.
    """
    c = P.cached_input_cost(prefix=7680, suffix=512, requests=10, read_rate=0.1, write_rate=1.25)
    assert c.baseline == 81_920
    assert c.cached == pytest.approx(21_632)
    assert c.amortized_cost_factor > 1
    assert round(c.amortized_cost_factor, 2) == 3.79
    once = P.cached_input_cost(prefix=7680, suffix=512, requests=1, read_rate=0.1, write_rate=1.25)
    assert once.amortized_cost_factor < 1  # one request only pays the write premium


def test_waste_formulas():
    """Naive reservation wastes (max - used)/max; paging ((b-1)/2)/(avg + (b-1)/2)."""
    assert P.naive_preallocation_waste(4096, 1024) == 0.75
    assert P.expected_paged_waste(1000, 16) == pytest.approx(7.5 / 1007.5)
    assert P.expected_paged_waste(1000, 1) == 0.0


# ---- validation: every error path ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(attention_layers=True), TypeError, "attention_layers=True: must be an int"),
        (dict(attention_layers=0), ValueError, "attention_layers=0: must be >= 1"),
        (dict(kv_heads=-1), ValueError, "kv_heads=-1"),
        (dict(head_dim=64.0), TypeError, "head_dim=64.0"),
        (dict(bytes_per_element=0), ValueError, "bytes_per_element=0"),
        (dict(sliding_layers=13, sliding_window=128), ValueError, "sliding_layers=13: must be <= attention_layers"),
        (dict(sliding_layers=6), ValueError, "needs sliding_window"),
        (dict(sliding_window=128), ValueError, "sliding_layers=0"),
        (dict(sliding_layers=6, sliding_window=0), ValueError, "sliding_window=0"),
        (dict(name=""), TypeError, "name=''"),
    ],
)
def test_attention_geometry_validation(kwargs, exc, match):
    """AttentionKVGeometry rejects booleans, non-positive sizes and inconsistent windows."""
    args = dict(name="g", attention_layers=12, kv_heads=4, head_dim=96)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        P.AttentionKVGeometry(**args)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(latent_dim=0), ValueError, "latent_dim=0"),
        (dict(rope_dim=-1), ValueError, "rope_dim=-1"),
        (dict(attention_layers=False), TypeError, "attention_layers=False"),
    ],
)
def test_mla_geometry_validation(kwargs, exc, match):
    """MLAKVGeometry rejects booleans and non-positive sizes."""
    args = dict(name="m", attention_layers=61, latent_dim=512, rope_dim=64)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        P.MLAKVGeometry(**args)


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((-1,), {}, ValueError, "context_tokens=-1: must be >= 0"),
        ((True,), {}, TypeError, "context_tokens=True"),
        ((10,), dict(batch_size=0), ValueError, "batch_size=0"),
        ((10,), dict(kv_scale=math.nan), ValueError, "must be finite"),
        ((10,), dict(kv_scale=math.inf), ValueError, "must be finite"),
        ((10,), dict(kv_scale=0.0), ValueError, "kv_scale=0.0: must be > 0"),
        ((10,), dict(kv_scale=True), TypeError, "kv_scale=True"),
        ((1,), dict(kv_scale=1 / 3), ValueError, "not a whole number of bytes"),
    ],
)
def test_payload_validation(args, kwargs, exc, match):
    """kv_payload_bytes rejects negative/bool context, zero batch, NaN/inf scales and fractional bytes."""
    with pytest.raises(exc, match=match):
        P.kv_payload_bytes(P.get_geometry("llama-3-8b"), *args, **kwargs)


def test_payload_rejects_non_geometry():
    """A payload needs a geometry object, not a name."""
    with pytest.raises(TypeError, match="must be an AttentionKVGeometry or MLAKVGeometry"):
        P.kv_payload_bytes("llama-3-8b", 10)


@pytest.mark.parametrize(
    "overrides, exc, match",
    [
        (dict(weight_bytes=0), ValueError, "weight_bytes=0"),
        (dict(weight_bytes=True), TypeError, "weight_bytes=True"),
        (dict(bandwidth_bytes_per_second=math.nan), ValueError, "bandwidth_bytes_per_second=nan"),
        (dict(peak_flops_per_second=-1.0), ValueError, "peak_flops_per_second=-1.0: must be > 0"),
        (dict(parameter_count=0), ValueError, "parameter_count=0"),
        (dict(runtime_reserve_bytes=-1), ValueError, "runtime_reserve_bytes=-1"),
        (dict(runtime_reserve_bytes=9001), ValueError, "exceed device_capacity_bytes=10000"),
        (dict(weight_bytes=20_000), ValueError, "exceed device_capacity_bytes"),
        (dict(resident_weight_bytes=999), ValueError, "resident_weight_bytes=999: must be >= 1000"),
    ],
)
def test_hardware_validation(overrides, exc, match):
    """ServingHardware rejects bad numbers and weights + reserve over capacity."""
    with pytest.raises(exc, match=match):
        _hw(**overrides)


def test_knee_and_capacity_need_nonzero_payload():
    """At zero context there is no KV, so neither a knee nor a capacity exists."""
    with pytest.raises(ValueError, match="payload is 0 B"):
        P.batch_knee(_hw(), LITE, 0)
    with pytest.raises(ValueError, match="payload is 0 B"):
        P.max_resident_requests(_hw(), LITE, 0)
    with pytest.raises(TypeError, match="must be a ServingHardware"):
        P.decode_ceiling(None, LITE, 1)


def test_flop_and_cost_validation():
    """FLOP, floor, cost and waste helpers reject bad counts, bools and NaN."""
    with pytest.raises(ValueError, match="queries=-1"):
        P.attention_flops(1, 1, 1, -1)
    with pytest.raises(TypeError, match="layers=True"):
        P.attention_flops(True, 1, 1, 1)
    with pytest.raises(ValueError, match="sliding_window=0"):
        P.attention_flops(1, 1, 1, 1, sliding_window=0)
    with pytest.raises(ValueError, match="keys=-1"):
        P.decode_flops(1, 1, 1, 1, keys=-1)
    with pytest.raises(ValueError, match="parameters=0"):
        P.prefill_flops(0, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="peak_flops_per_second=inf"):
        P.prefill_floor_seconds(1, 1, math.inf)
    with pytest.raises(ValueError, match="requests=0"):
        P.cached_input_cost(1, 1, 0)
    with pytest.raises(ValueError, match="read_rate=nan"):
        P.cached_input_cost(1, 1, 1, read_rate=math.nan)
    with pytest.raises(ValueError, match="at least one input token"):
        P.cached_input_cost(0, 0, 1)
    with pytest.raises(ValueError, match="used_tokens=5: must be <= max_tokens=4"):
        P.naive_preallocation_waste(4, 5)
    with pytest.raises(ValueError, match="max_tokens=0"):
        P.naive_preallocation_waste(0, 0)
    with pytest.raises(ValueError, match="block_size=0"):
        P.expected_paged_waste(10, 0)
    with pytest.raises(ValueError, match="avg_tokens=0"):
        P.expected_paged_waste(0, 16)


def test_preset_lookup_and_model_weights_validation():
    """Unknown presets list the valid names; active parameters cannot exceed total."""
    with pytest.raises(ValueError, match="unknown geometry preset 'llama-9'.*llama-3-8b"):
        P.get_geometry("llama-9")
    with pytest.raises(ValueError, match="unknown hardware preset 'tpu'.*this-machine"):
        P.get_hardware("tpu")
    with pytest.raises(ValueError, match="active_parameters=2: must be <= total_parameters=1"):
        P.ModelWeights("m", 1, 2)
    with pytest.raises(ValueError, match="devices=0"):
        P.serving_hardware(P.get_hardware("h200"), P.MODEL_WEIGHTS["llama-3-8b"], devices=0)
    with pytest.raises(ValueError, match=r"exceed 1 x a100-80gb .*use more devices \(at least 2\)"):
        P.serving_hardware(P.get_hardware("a100-80gb"), P.MODEL_WEIGHTS["llama-3.3-70b"])
    with pytest.raises(ValueError, match="runtime_reserve_bytes=-1"):
        P.serving_hardware(P.get_hardware("h200"), P.MODEL_WEIGHTS["llama-3-8b"], runtime_reserve_bytes=-1)


def test_hf_config_validation():
    """HF config parsing rejects missing keys, indivisible widths and unknown layer types."""
    with pytest.raises(TypeError, match="must be a dict"):
        P.geometry_from_hf_config([])
    with pytest.raises(ValueError, match="no 'num_hidden_layers'"):
        P.geometry_from_hf_config({"num_attention_heads": 8})
    with pytest.raises(ValueError, match="hidden_size=100 is not divisible by num_attention_heads=8"):
        P.geometry_from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 100})
    with pytest.raises(ValueError, match="layer_types has 1 entries; num_hidden_layers=2"):
        P.geometry_from_hf_config(
            {"num_hidden_layers": 2, "num_attention_heads": 1, "head_dim": 8, "layer_types": ["full_attention"]}
        )
    with pytest.raises(ValueError, match="'chunked'"):
        P.geometry_from_hf_config(
            {"num_hidden_layers": 1, "num_attention_heads": 1, "head_dim": 8, "layer_types": ["chunked"]}
        )


def test_gpt_oss_weights_are_counted_with_mxfp4_experts():
    """gpt-oss-20b as released: bf16 dense weights, routed experts at 4.25 bits (resident 13.76 GB, 3.71 GB
    read per decode step); the same counts at 16 bits give the dequantised 41.83 / 7.22 GB."""
    from gptoss_lite.commands.plan import build_report

    w = P.MODEL_WEIGHTS["gpt-oss-20b"]
    cfg = PRESETS["gpt-oss-20b"]
    experts = cfg.n_layers * cfg.n_experts * 3 * cfg.d_model * cfg.expert_hidden
    assert w.expert_parameters == experts and w.active_expert_parameters == experts * cfg.top_k // cfg.n_experts
    dense = w.total_parameters - experts
    assert w.resident_weight_bytes == math.ceil(dense * 2 + experts * 4.25 / 8)
    assert round(w.resident_weight_bytes / 1e9, 2) == 13.76 and round(w.streamed_weight_bytes / 1e9, 2) == 3.71
    args = dict(hardware="a100-80gb", contexts=[4096], batches=[1], kv_bits=[16], chunk=2048)
    packed = build_report("gpt-oss-20b", **args)["model"]
    dequantised = build_report("gpt-oss-20b", **args, expert_bits=16)["model"]
    assert packed["expert_bytes_per_parameter"] == 4.25 / 8
    assert round(dequantised["resident_weight_bytes"] / 1e9, 2) == 41.83
    assert round(dequantised["streamed_weight_bytes"] / 1e9, 2) == 7.22
    assert P.MODEL_WEIGHTS["gptoss-lite-502m"].expert_bytes == 2.0  # ours: stored like the rest
