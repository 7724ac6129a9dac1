"""One sampling-parameter type and one top-p nucleus in the package (read with ast, nothing imported).

`gptoss_lite.sampling.SamplingParams` is what `generate()` and the engine both take; a second class
of that name, or the old `SamplingConfig`, would bring back two sets of defaults. `_nucleus` is the
one top-p keep rule that `sample` and `probabilities` (and so speculative verification) share; a
second copy could drift from it and break the speculative-sampling exactness argument.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "gptoss_lite"
SRC = Path(__file__).resolve().parent.parent / "src" / PACKAGE

CUMULATIVE = {"cumsum", "accumulate"}  # x.cumsum / torch.cumsum / np.cumsum, itertools.accumulate
SORTING = {"sort", "argsort", "sorted", "topk", "msort"}
NUCLEUS_NAMES = ("nucleus", "top_p", "topp")


def modules(root: Path = SRC) -> dict[str, ast.Module]:
    """{dotted module name: parsed tree} of every .py file under the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = ast.parse(path.read_text(), str(path))
    return out


def class_definitions(root: Path = SRC) -> dict[str, list[str]]:
    """{class name: the modules defining a class of that name}, nested classes included."""
    found: dict[str, list[str]] = {}
    for module, tree in modules(root).items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(module)
    return found


def _own_calls(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Names called in fn's own body (`x.cumsum(...)` and `torch.cumsum(...)` both give "cumsum"),
    not in the functions, lambdas or classes defined inside it (those are counted on their own)."""
    called: set[str] = set()
    todo: list[ast.AST] = list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute):
                called.add(node.func.attr)
            elif isinstance(node.func, ast.Name):
                called.add(node.func.id)
        todo.extend(ast.iter_child_nodes(node))
    return called


def _functions(tree: ast.Module, prefix: str):
    """(qualified name, node) of every function in the tree, methods and nested functions included."""
    todo: list[tuple[str, ast.AST]] = [(prefix, tree)]
    while todo:
        name, node = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                todo.append((f"{name}.{child.name}", child))
                yield f"{name}.{child.name}", child
            elif isinstance(child, ast.ClassDef):
                todo.append((f"{name}.{child.name}", child))
            else:
                todo.append((name, child))


def nucleus_functions(root: Path = SRC) -> list[str]:
    """Qualified names of the functions that look like a top-p nucleus: named for it, or computing a
    cumulative sum of something they sort (the top-p keep rule needs both), sorted."""
    found = []
    for module, tree in modules(root).items():
        for name, fn in _functions(tree, module):
            calls = _own_calls(fn)
            named = any(word in fn.name.lower() for word in NUCLEUS_NAMES)
            if named or (calls & CUMULATIVE and calls & SORTING):
                found.append(name)
    return sorted(found)


def test_one_sampling_params_class_and_no_sampling_config():
    """Exactly one class named SamplingParams (in gptoss_lite.sampling), none named SamplingConfig."""
    classes = class_definitions()
    assert classes.get("SamplingParams") == ["gptoss_lite.sampling"], classes.get("SamplingParams")
    assert classes.get("SamplingConfig", []) == []  # the modules that define one, if any
    assert len(classes) > 30  # the tree is really read


def test_one_nucleus_implementation():
    """The top-p keep rule exists once: gptoss_lite.sampling._nucleus, which sample and probabilities call."""
    assert nucleus_functions() == ["gptoss_lite.sampling._nucleus"]
    tree = modules()["gptoss_lite.sampling"]
    callers = {n for n, fn in _functions(tree, "gptoss_lite.sampling") if "_nucleus" in _own_calls(fn)}
    assert callers == {"gptoss_lite.sampling.sample", "gptoss_lite.sampling.probabilities"}


def test_the_engine_exports_the_sampling_class_itself():
    """Old imports keep working, and they give the same class, not a look-alike."""
    import gptoss_lite.engine
    import gptoss_lite.engine.request
    import gptoss_lite.sampling

    cls = gptoss_lite.sampling.SamplingParams
    assert gptoss_lite.engine.SamplingParams is cls and gptoss_lite.engine.request.SamplingParams is cls
    assert not hasattr(gptoss_lite.sampling, "SamplingConfig")


def test_the_checkers_flag_a_second_definition(tmp_path):
    """The checkers themselves: a second SamplingParams, a SamplingConfig, a second nucleus written
    with torch.cumsum (even nested in another function) and one only named for it are all reported; a
    cumulative sum without sorting (positions, offsets) is not."""
    pkg = tmp_path / "gptoss_lite"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "sampling.py").write_text(
        "class SamplingParams:\n"
        "    pass\n"
        "def _nucleus(probs, top_p):\n"
        "    p, i = probs.sort(dim=-1, descending=True)\n"
        "    return p.cumsum(dim=-1) - p, i\n"
    )
    (pkg / "engine" / "request.py").write_text(
        "import torch\n"
        "class SamplingParams:\n"
        "    class SamplingConfig:\n"
        "        pass\n"
        "class Request:\n"
        "    def step(self, logits):\n"
        "        def keep(probs):\n"
        "            ordered = torch.sort(probs, descending=True).values\n"
        "            return torch.cumsum(ordered, -1) < 0.9\n"
        "        return keep(logits.softmax(-1))\n"
        "def offsets(lengths):\n"
        "    return lengths.cumsum(0)\n"
        "def apply_top_p(probs, p):\n"
        "    return probs\n"
    )
    classes = class_definitions(pkg)
    assert classes["SamplingParams"] == ["gptoss_lite.engine.request", "gptoss_lite.sampling"]
    assert classes["SamplingConfig"] == ["gptoss_lite.engine.request"]
    assert nucleus_functions(pkg) == [
        "gptoss_lite.engine.request.Request.step.keep",
        "gptoss_lite.engine.request.apply_top_p",
        "gptoss_lite.sampling._nucleus",
    ]
