"""CLI smoke tests for `gptoss-lite plan` and `gptoss-lite kv-bench` through cli.main."""

from __future__ import annotations

import json

import pytest

from gptoss_lite.cli import main


def test_plan_text_labels_and_units(capsys):
    """`plan` prints every section, labelled payload / upper bound, with GiB and GB units."""
    assert main(["plan", "--context", "4096", "131072", "--batch", "1", "8"]) == 0
    out = capsys.readouterr().out
    for text in (
        "KV ladder (payload",
        "Decode ceilings (upper bound",
        "ridge 153.0 FLOP/B",
        "Batch knee",
        "capacity (upper bound",
        "Prefill",
        "chunked stall",
        "Compression scenarios",
        "1,209,139,200",
        "GiB",
        "GB/s",
        "18.00 KiB/token",
    ):
        assert text in out, text


def test_plan_json_is_stable_and_parses(capsys):
    """`plan --json` emits sorted-key JSON whose figures match the library (schema_version 2)."""
    assert (
        main(
            [
                "plan",
                "--json",
                "--model",
                "llama-3.3-70b",
                "--hardware",
                "h200",
                "--devices",
                "2",
                "--context",
                "131072",
                "--batch",
                "1",
                "--kv-bits",
                "16",
                "8",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    report = json.loads(text)
    assert text.strip() == json.dumps(report, sort_keys=True, indent=2)
    assert report["schema_version"] == 2
    assert report["kv_ladder"][0]["payload_bytes"] == 40 * 2**30
    assert [row["kv_bits"] for row in report["capacity"]] == [16, 8]
    assert report["capacity"][1]["payload_bytes"] == 20 * 2**30
    assert report["decode_ceilings"][0]["memory_bound"] is True


def test_plan_accepts_model_config_preset(capsys):
    """A ModelConfig preset name (not a geometry preset) also works as --model."""
    assert main(["plan", "--json", "--model", "lite-tiny", "--context", "16", "--batch", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    geometry = report["model"]["geometry"]
    assert geometry["sliding_layers"] == 2 and geometry["sliding_window"] == 8
    assert not {"sliding_window_layers", "window"} & set(geometry)  # schema 2 uses the house words
    ladder = report["kv_ladder"][0]
    assert ladder["all_full_payload_bytes"] >= ladder["payload_bytes"] and "all_global_payload_bytes" not in ladder


def test_plan_unknown_model_is_a_clear_error(capsys):
    """An unknown --model exits 2 with the valid names listed."""
    assert main(["plan", "--model", "nope"]) == 2
    assert "unknown model 'nope'; valid:" in capsys.readouterr().err


def test_plan_weights_over_capacity_suggest_devices(capsys):
    """A model too big for one chip exits 2 and says to use more devices."""
    assert main(["plan", "--model", "llama-3.3-70b"]) == 2
    assert "use more devices (at least 2)" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-3.3-70b", "--devices", "2", "--json"]) == 0


def test_plan_writes_png(tmp_path, capsys):
    """`--plot` writes a PNG file (magic bytes checked)."""
    out = tmp_path / "plan.png"
    assert main(["plan", "--plot", str(out), "--context", "4096", "8192"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kv_bench_passes(capsys):
    """`kv-bench` reproduces docs/kv-cache.md#kv-arithmetic-of-the-502m-preset at 128K, prints PASS, exits 0."""
    assert main(["kv-bench"]) == 0
    out = capsys.readouterr().out
    assert "2,415,919,104" in out and "1,209,139,200" in out
    assert "1.94x" in out and "1.97x" in out and "1.99x" in out
    assert "PASS: mixed cache payload is 2.00x" in out
    assert "6 sliding layers (ring, W=128) + 6 full vs all 12 full" in out and "global" not in out
    assert main(["kv-bench", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is True and report["rows"][-1]["all_full_bytes"] == 2_415_919_104


def test_plan_weight_bits_fit_gpt_oss_120b_on_one_h100(capsys):
    """gpt-oss-120b as released (MXFP4 experts) fits one 80 GB H100; with the experts in BF16 it does not."""
    assert main(["plan", "--model", "gpt-oss-120b", "--hardware", "h100-sxm", "--expert-bits", "16"]) == 2
    assert "at least 3" in capsys.readouterr().err
    assert main(["plan", "--json", "--model", "gpt-oss-120b", "--hardware", "h100-sxm"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["expert_bytes_per_parameter"] == 4.25 / 8 and model["bytes_per_parameter"] == 2
    assert main(["plan", "--json", "--model", "gpt-oss-120b", "--hardware", "h100-sxm", "--weight-bits", "4.25"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["bytes_per_parameter"] == 4.25 / 8
    assert main(["plan", "--expert-bits", "0"]) == 2
    assert "--expert-bits 0.0: must be in (0, 64]" in capsys.readouterr().err
    assert main(["plan", "--weight-bits", "0"]) == 2
    assert "--weight-bits 0.0: must be in (0, 64]" in capsys.readouterr().err
    assert main(["plan", "--kv-bits", "0"]) == 2
    assert "--kv-bits 0: must be >= 1" in capsys.readouterr().err


def test_kv_bench_measured_cache_matches_formula():
    """A real MixedKVCache of the 502M geometry holds exactly the computed mixed payload."""
    from gptoss_lite import plan as P
    from gptoss_lite.commands.kv_bench import measure_mixed_cache

    measured = measure_mixed_cache((100, 300), chunk=128)
    geometry = P.get_geometry("gptoss-lite-502m")
    for t, (payload, allocated) in measured.items():
        assert payload == P.kv_payload_bytes(geometry, t)
        assert payload <= allocated <= 1.5 * payload + 6 * 128 * 1536


def test_plan_huge_context_returns_at_once(capsys):
    """`plan --context 10**30` finishes (it used to loop over every prefill chunk and never end)."""
    import time

    t0 = time.perf_counter()
    assert main(["plan", "--context", str(10**12), str(10**30), "--json"]) == 0
    assert time.perf_counter() - t0 < 10
    prefill = json.loads(capsys.readouterr().out)["prefill"]
    assert [x["context_tokens"] for x in prefill] == [10**12, 10**30]


@pytest.mark.parametrize(
    "context, chunk", [(1, 1), (5, 2), (2048, 2048), (2049, 2048), (4095, 1000), (300, 7), (129, 128), (1000, 3000)]
)
def test_worst_chunk_is_the_brute_force_maximum(context, chunk):
    """The two-candidate worst prefill chunk equals the maximum over every chunk, windowed layers included."""
    from gptoss_lite.commands.plan import _prefill_chunk_flops, _worst_chunk_flops, resolve_model

    for model in ("gptoss-lite-502m", "gpt-oss-20b"):
        geometry, weights = resolve_model(model)
        brute = max(
            _prefill_chunk_flops(geometry, weights, min(chunk, context - s), s) for s in range(0, context, chunk)
        )
        assert _worst_chunk_flops(geometry, weights, context, chunk) == brute


def test_plan_kv_bits_without_the_native_width_prints(capsys):
    """--kv-bits that omit the native width leave an empty capacity table, not a TypeError."""
    assert main(["plan", "--kv-bits", "8", "--context", "4096"]) == 0
    assert "Prefill" in capsys.readouterr().out


def test_plan_measured_bytes_beside_the_scenarios(capsys):
    """`plan --measured` fills real caches: the JSON carries measured_bytes per (kv-bits, context), int8/int4
    within 5% of with_scales_bytes (scales counted), and the text table a measured column."""
    argv = ["plan", "--model", "lite-tiny", "--context", "8192", "--batch", "1", "--kv-bits", "16", "8", "4"]
    assert main([*argv, "--measured", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["capacity"]
    for row in rows:
        assert row["measured_bytes"] > 0
        if row["kv_bits"] != 16:
            assert row["with_scales_bytes"] > row["payload_bytes"]
            assert abs(row["measured_bytes"] - row["with_scales_bytes"]) <= 0.05 * row["with_scales_bytes"]
    assert main([*argv, "--measured"]) == 0
    assert "measured GiB" in capsys.readouterr().out
    assert main(["plan", "--model", "llama-3.3-70b", "--devices", "2", "--measured"]) == 2
    assert "not one of our model presets" in capsys.readouterr().err
