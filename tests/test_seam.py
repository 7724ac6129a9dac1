"""The layer/cache seam, counted on the tree (read with ast, nothing imported): the model reaches the KV
package only through kv.base and never asks which cache class it holds, and no engine module computes
a softmax (attention lives in the model; the engine stores, gathers and schedules)."""

from __future__ import annotations

import ast
from pathlib import Path

from test_import_graph import SRC, import_graph

CACHE_CLASSES = {
    "MixedKVCache",
    "RingBuffer",
    "GrowingBuffer",
    "QuantizedKVCache",
    "QuantizedBuffer",
    "EvictingKVCache",
    "EvictingBuffer",
    "PagedKVStore",
    "QuantizedPagedStore",
    "PagedBatch",
    "PagedDecode",
    "StaticMixed",
}
SOFTMAX_NAMES = {"softmax", "log_softmax", "logsumexp", "_softmax", "_scaled_dot_product_flash_attention_for_cpu"}


def _files(package: str) -> list[Path]:
    return sorted((SRC / package).rglob("*.py"))


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def test_model_imports_only_kv_base_from_kv():
    graph = import_graph()
    reached = {
        target
        for module, targets in graph.items()
        if module.startswith("gptoss_lite.model")
        for target in targets
        if target.startswith("gptoss_lite.kv")
    }
    assert reached == {"gptoss_lite.kv.base"}, reached


def test_model_never_dispatches_on_a_cache_class():
    """No isinstance(x, SomeCache) or type(x) is SomeCache anywhere under model/."""
    found = []
    for path in _files("model"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            called = node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else None
            if called in ("isinstance", "type"):
                hit = _names(node) & CACHE_CLASSES
                if hit:
                    found.append(f"{path.name}:{node.lineno} {sorted(hit)}")
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                if any(isinstance(c, ast.Call) and getattr(c.func, "id", None) == "type" for c in ast.walk(node)):
                    hit = _names(node) & CACHE_CLASSES
                    if hit:
                        found.append(f"{path.name}:{node.lineno} {sorted(hit)}")
    assert not found, found


def test_no_engine_module_computes_a_softmax():
    """Calls named softmax / log_softmax / logsumexp / exp, or the fused attention kernel, under engine/."""
    found = []
    for path in _files("engine"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in SOFTMAX_NAMES or name == "exp":
                    found.append(f"{path.name}:{node.lineno} {name}")
    assert not found, found


def test_the_checks_would_catch_a_violation(tmp_path):
    """The AST checks above see what they look for (a check that cannot fail proves nothing)."""
    code = "import torch\nfrom gptoss_lite.kv.mixed import MixedKVCache\n"
    code += "def f(c, s):\n    if isinstance(c, MixedKVCache) or type(c) is MixedKVCache:\n"
    code += "        return torch.softmax(s, -1)\n"
    tree = ast.parse(code)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert any(getattr(c.func, "id", None) == "isinstance" and _names(c) & CACHE_CLASSES for c in calls)
    assert any(isinstance(c.func, ast.Attribute) and c.func.attr in SOFTMAX_NAMES for c in calls)
