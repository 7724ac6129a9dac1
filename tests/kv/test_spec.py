"""The KV spec (`gptoss_lite.kvspec`): bytes by hand, formats, layer kinds, and the AST rules that keep
it the one place a layer's storage is described."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from gptoss_lite.config import FULL, SLIDING
from gptoss_lite.fixtures import resolve_config
from gptoss_lite.kvspec import DENSE, INT4, INT8, LayerKind, LayerKVSpec, kv_format, model_kv_specs

SRC = Path(__file__).resolve().parents[2] / "src" / "gptoss_lite"


def spec(fmt=DENSE, window=None, element_bytes=2, k=(8, 64), v=(8, 64), value_group=None):
    return LayerKVSpec(LayerKind.FULL, window, fmt, element_bytes, k[0], k[1], v[0], v[1], value_group)


def test_dense_bytes_by_hand():
    s = spec()
    assert s.token_bytes == 2 * 8 * 64 * 2  # K and V, 8 heads of 64, bf16
    assert s.block_bytes(16) == 16 * 2048
    # K and V may differ (another attention family): 4 heads of 32 keys, 8 heads of 64 values
    assert spec(k=(4, 32), v=(8, 64)).token_bytes == (4 * 32 + 8 * 64) * 2


@pytest.mark.parametrize("fmt, bits", [(INT8, 8), (INT4, 4)])
def test_quantized_bytes_by_hand(fmt, bits):
    s = spec(fmt)
    n, g = 128, 64
    codes = 2 * 8 * 64 * n * bits // 8
    key_scales = 2 * 2 * 8 * 64 * (n // g)  # a float16 scale and zero per channel per key group
    value_scales = 2 * 2 * 8 * (64 // 64) * n  # ... per value group (64 channels) per token
    assert s.quantized_bytes(n, g) == codes + key_scales + value_scales
    assert s.block_bytes(16) == s.quantized_bytes(16, 16)  # a block is its own key group
    with pytest.raises(ValueError, match="whole number of key groups"):
        s.quantized_bytes(100, 64)
    with pytest.raises(ValueError, match="no codes"):
        spec().quantized_bytes(64, 64)


def test_formats_by_name_and_by_the_older_bit_counts():
    assert kv_format("int8") is INT8 and kv_format(8) is INT8 and kv_format(16) is DENSE and kv_format(INT4) is INT4
    for bad in ("fp7", 12, True, None):
        with pytest.raises(ValueError, match="KV format"):
            kv_format(bad)
    assert (DENSE.label, INT8.label, INT4.label) == ("16-bit", "int8", "int4")


def test_a_value_group_must_divide_the_value_dim():
    with pytest.raises(ValueError, match="value_group=48"):
        spec(INT8, value_group=48)
    assert spec(INT8, v=(8, 96)).group == 96  # 64 does not divide 96: one group per token


def test_model_specs_follow_the_layer_kinds():
    config = resolve_config("lite-tiny")
    specs = model_kv_specs(config, 4, INT8)
    for layer, s in enumerate(specs):
        if config.is_sliding(layer):
            assert (s.kind, s.window, s.format) == (LayerKind.SLIDING, config.sliding_window, DENSE)
        else:
            assert (s.kind, s.window, s.format) == (LayerKind.FULL, None, INT8)
    windowed = model_kv_specs(config, 4, full_window=512)
    assert {s.window for s in windowed if s.kind is LayerKind.FULL} == {512}
    with pytest.raises(ValueError, match="give one of them"):
        model_kv_specs(config, 4, INT8, full_window=512)
    assert specs[1].resident_tokens(10_000) == 10_000 and specs[0].resident_tokens(10_000) == config.sliding_window


def test_a_layer_kind_is_its_hugging_face_word():
    assert LayerKind.FULL == FULL and LayerKind.SLIDING == SLIDING
    assert {LayerKind.FULL: 1}[FULL] == 1  # dicts keyed by kind answer the word too
    assert json.dumps({LayerKind.FULL: LayerKind.SLIDING}) == json.dumps({FULL: SLIDING})


# ---- the rules -------------------------------------------------------------------------------------------

HEADS = {"n_kv_heads", "kv_heads", "k_heads", "v_heads", "K"}
DIMS = {"head_dim", "k_dim", "v_dim", "D"}
ELEMENT = {"element_size", "itemsize", "element_bytes", "bytes_per_element"}


def _factor_names(node: ast.AST) -> set[str]:
    """The names a product multiplies: `cfg.head_dim` is head_dim, `x.element_size()` element_size; a
    call's arguments are its own business (`token_bytes(K, D, K, D, e)` is one factor, token_bytes)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _factor_names(node.left) | _factor_names(node.right)
    if isinstance(node, ast.Call):
        return _factor_names(node.func)
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def _byte_products(tree: ast.AST) -> list[int]:
    """Lines of outermost products that multiply a KV-head count, a head dim and an element size."""
    hits, inner = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and id(node) not in inner:
            inner.update(id(n) for n in ast.walk(node) if n is not node)
            names = _factor_names(node)
            if names & HEADS and names & DIMS and names & ELEMENT:
                hits.append(node.lineno)
    return hits


def test_the_per_token_byte_formula_is_written_once():
    found = {
        f"{path.relative_to(SRC)}:{line}"
        for path in SRC.rglob("*.py")
        for line in _byte_products(ast.parse(path.read_text(), str(path)))
    }
    assert found == {"kvspec.py:" + str(_line_of_token_bytes())}, sorted(found)


def _line_of_token_bytes() -> int:
    tree = ast.parse((SRC / "kvspec.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "token_bytes")
    return next(n.lineno for n in ast.walk(fn) if isinstance(n, ast.BinOp))


def test_the_byte_rule_catches_a_second_formula():
    tree = ast.parse("per = 2 * cfg.n_kv_heads * cfg.head_dim * x.element_size()\nshape = K * D\n")
    assert _byte_products(tree) == [1]


# The Hugging Face words are read and written where a checkpoint's config is: config.py (layer_types)
# and checkpoint/hf.py. Everything else asks a spec (its kind, window, format) or LayerKind.
KIND_WORDS = {"full_attention", "sliding_attention"}
WORD_HOMES = {"config.py", "kvspec.py", "checkpoint/hf.py"}


def _kind_word_uses(tree: ast.AST) -> list[str]:
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "gptoss_lite.config":
            uses += [f"imports {a.name}" for a in node.names if a.name in ("FULL", "SLIDING")]
        if isinstance(node, ast.Constant) and node.value in KIND_WORDS:
            uses.append(f"the string {node.value!r}")
    return uses


def test_no_layer_kind_strings_outside_the_spec():
    found = [
        f"{path.relative_to(SRC)}: {use}"
        for path in sorted(SRC.rglob("*.py"))
        if str(path.relative_to(SRC)) not in WORD_HOMES
        for use in _kind_word_uses(ast.parse(path.read_text(), str(path)))
    ]
    assert not found, found


def test_the_kind_rule_catches_a_stray_word():
    tree = ast.parse("from gptoss_lite.config import FULL\nif kind == 'sliding_attention':\n    pass\n")
    assert _kind_word_uses(tree) == ["imports FULL", "the string 'sliding_attention'"]


def test_the_spec_needs_no_torch():
    tree = ast.parse((SRC / "kvspec.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | {
        n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
    }
    assert not {m for m in imported if m and m.split(".")[0] == "torch"}
    assert imported <= {"__future__", "enum", "dataclasses", "gptoss_lite.config", "gptoss_lite.validation"}
