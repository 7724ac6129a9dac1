"""The package's import graph has no cycle, function-local imports included (read with ast, nothing imported)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "gptoss_lite"
SRC = Path(__file__).resolve().parent.parent / "src" / PACKAGE


def module_files(root: Path = SRC) -> dict[str, Path]:
    """{dotted module name: file} of every .py file under the package (a package is its __init__)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported_modules(module: str, path: Path, known: set[str]) -> set[str]:
    """Package modules `module` imports anywhere in its file (top level, functions, TYPE_CHECKING blocks).

    `from a import b` counts as importing `a.b` when that is a module, else `a`.
    """
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target)
    return {name for name in found if name in known and name != module}


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    files = module_files(root)
    return {m: imported_modules(m, p, set(files)) for m, p in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None; iterative DFS with white/grey/black colouring."""
    colour = dict.fromkeys(graph, 0)  # 0 unvisited, 1 on the current path, 2 done
    for start in sorted(graph):
        if colour[start]:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        colour[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                colour[path.pop()] = 2
                stack.pop()
            elif colour.get(nxt, 2) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif colour.get(nxt) == 0:
                colour[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_cycle_finder_finds_a_hidden_cycle(tmp_path):
    """The checker itself: a cycle closed only by a function-local import is reported; a DAG is not."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "native.py").write_text("from pkg.hf import load\n")
    (pkg / "hf.py").write_text("def load():\n    from .native import check\n")
    assert import_graph(pkg) == {"pkg": set(), "pkg.native": {"pkg.hf"}, "pkg.hf": {"pkg.native"}}
    assert find_cycle(import_graph(pkg)) == ["pkg.hf", "pkg.native", "pkg.hf"]


def test_graph_sees_known_edges():
    """The graph is really read: it holds edges we know exist (top-level and function-local)."""
    graph = import_graph()
    assert "gptoss_lite.checkpoint.state_dict" in graph["gptoss_lite.checkpoint.hf"]
    assert "gptoss_lite.validation" in graph["gptoss_lite.config"]
    assert len(graph) > 30


def test_package_has_no_import_cycle():
    """No chain of imports among gptoss_lite modules leads back to where it started."""
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# Which sub-packages a layer may never import (docs/architecture.md#who-imports-whom).
FORBIDDEN = {
    "gptoss_lite.kv": (
        "gptoss_lite.model",
        "gptoss_lite.generation",
        "gptoss_lite.speculative",
        "gptoss_lite.engine",
        "gptoss_lite.server",
        "gptoss_lite.commands",
    ),
    "gptoss_lite.model": (
        "gptoss_lite.engine",
        "gptoss_lite.server",
        "gptoss_lite.generation",
        "gptoss_lite.speculative",
        "gptoss_lite.checkpoint",
        "gptoss_lite.evals",
        "gptoss_lite.train",
        "gptoss_lite.commands",
    ),
    "gptoss_lite.plan": ("gptoss_lite.model", "gptoss_lite.kv", "gptoss_lite.generation"),
    "gptoss_lite.config": ("gptoss_lite.model", "gptoss_lite.kv", "gptoss_lite.kvspec"),
    # what a layer stores: read by the planner, the caches and the engine, so below all of them
    "gptoss_lite.kvspec": (
        "gptoss_lite.model",
        "gptoss_lite.kv",
        "gptoss_lite.plan",
        "gptoss_lite.engine",
        "gptoss_lite.generation",
        "gptoss_lite.checkpoint",
    ),
    # the engine runs the model; it is not a command and never knows about HTTP
    "gptoss_lite.engine": ("gptoss_lite.server", "gptoss_lite.commands", "gptoss_lite.generation"),
    # evaluation and training sit side by side: what both need (the filler) lives below them
    "gptoss_lite.evals": ("gptoss_lite.train", "gptoss_lite.commands"),
    "gptoss_lite.filler": ("gptoss_lite",),
}


def test_layers_import_only_downwards():
    """kv never imports the model, generation or the engine; the model never imports what runs it;
    plan and config stay below both (the arrows of docs/architecture.md)."""
    graph = import_graph()
    broken = [
        f"{m} -> {dep}"
        for m, deps in graph.items()
        for layer, banned in FORBIDDEN.items()
        if m == layer or m.startswith(layer + ".")
        for dep in deps
        if any(dep == b or dep.startswith(b + ".") for b in banned)
    ]
    assert not broken, broken


# What a layer may import from the package, when that is shorter to say than what it may not.
ALLOWED_ONLY = {
    # the server also runs gpt-oss's built-in tools (browser, python) inside /v1/responses
    "gptoss_lite.server": (
        "gptoss_lite.server",
        "gptoss_lite.engine",
        "gptoss_lite.harmony",
        "gptoss_lite.grammar",
        "gptoss_lite.tools",
    ),
    # the tools know nothing of the model, the engine or the server
    "gptoss_lite.tools": ("gptoss_lite.tools",),
    # the harmony format (render, parse, vocabulary) knows nothing of the model or what runs it
    "gptoss_lite.harmony": ("gptoss_lite.harmony",),
    # structured output: a logits processor over llguidance (and harmony's parser for the final channel)
    "gptoss_lite.grammar": ("gptoss_lite.grammar", "gptoss_lite.harmony"),
}


def allowlist_violations(graph: dict[str, set[str]]) -> list[str]:
    """'module -> dep' for every import of a package module outside its layer's allowlist."""
    return [
        f"{m} -> {dep}"
        for m, deps in sorted(graph.items())
        for layer, allowed in ALLOWED_ONLY.items()
        if m == layer or m.startswith(layer + ".")
        for dep in sorted(deps)
        if not any(dep == a or dep.startswith(a + ".") for a in allowed)
    ]


def test_server_imports_only_the_engine():
    """The HTTP server talks to the model only through the engine (and speaks harmony through the
    format package): its modules import nothing else of the package (stdlib and third-party
    libraries are not in the graph)."""
    graph = import_graph()
    assert "gptoss_lite.engine" in graph["gptoss_lite.server.serving"]
    broken = allowlist_violations(graph)
    assert not broken, broken


def test_allowlist_rule_catches_a_stray_import(tmp_path):
    """The allowlist check itself: a server module importing the model is reported, the engine is not."""
    pkg = tmp_path / "gptoss_lite"
    for d in (pkg, pkg / "server", pkg / "engine", pkg / "model"):
        d.mkdir(parents=True, exist_ok=True)
        (d / "__init__.py").write_text("")
    (pkg / "server" / "api.py").write_text("from gptoss_lite.engine import LLM\nfrom gptoss_lite.model import GPTOSS\n")
    assert allowlist_violations(import_graph(pkg)) == ["gptoss_lite.server.api -> gptoss_lite.model"]


#: The engine's two doors to KV. Block bookkeeping (the store's KV groups, their pools and prefix
#: caches) is the KV manager's alone; the device tensors (the store) are the runner's and the batch
#: view it builds, and the draft model's own store its drafter's (which keeps its blocks through a
#: KVManager of its own). So the scheduler and the manager deal in block ids, and the device side in
#: tensors.
KV_DOORS = {
    "kv_manager.py": {"groups", "pools", "prefix"},
    "runner.py": {"store"},
    "paged_batch.py": {"store"},
    "paged_decode.py": {"store"},
    "drafting.py": {"store"},
}
KV_INSIDES = {"store", "groups", "pools", "prefix"}


def kv_door_violations(engine_dir: Path) -> list[str]:
    """'file:line .name' for every read of a store, its KV groups, pools or prefix caches in an engine
    module that is not that thing's door."""
    found = []
    for path in sorted(engine_dir.glob("*.py")):
        allowed = KV_DOORS.get(path.name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in KV_INSIDES - allowed:
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
    return found


def test_only_the_kv_manager_touches_blocks_and_only_the_runner_touches_tensors():
    """KVManager is the one door to the pools and prefix caches (the scheduler and the facade ask it);
    the runner is the one door to the store's tensors."""
    engine = Path(__file__).resolve().parents[1] / "src" / "gptoss_lite" / "engine"
    broken = kv_door_violations(engine)
    assert not broken, broken


def test_the_kv_door_rule_catches_a_stray_read(tmp_path):
    (tmp_path / "scheduler.py").write_text("def f(kv):\n    return kv.store.pools, kv.groups[0].window\n")
    (tmp_path / "kv_manager.py").write_text("def g(self):\n    return self.store.k, self.groups\n")
    (tmp_path / "runner.py").write_text("def h(self):\n    return self.store.k, self.store.pools\n")
    assert sorted(kv_door_violations(tmp_path)) == [
        "kv_manager.py:2 .store",
        "runner.py:2 .pools",
        "scheduler.py:2 .groups",
        "scheduler.py:2 .pools",
        "scheduler.py:2 .store",
    ]


def test_the_scheduler_and_the_kv_manager_hold_no_tensors():
    """The engine's core deals in block ids and counts: neither module names torch (the runner makes
    the copy-on-write copies and builds the batch), and the manager keeps to at most 15 public
    methods and properties."""
    engine = Path(__file__).resolve().parents[1] / "src" / "gptoss_lite" / "engine"
    for name in ("scheduler.py", "kv_manager.py"):
        tree = ast.parse((engine / name).read_text())
        named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "torch" not in named | imported | modules, name
    manager = next(
        n
        for n in ast.parse((engine / "kv_manager.py").read_text()).body
        if isinstance(n, ast.ClassDef) and n.name == "KVManager"
    )
    public = [f.name for f in manager.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")]
    assert len(public) <= 15, public


def runner_request_writes(source: str) -> list[str]:
    """'line name.attr' for every attribute the code assigns on anything but `self`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        )
        for target in targets:
            if isinstance(target, ast.Attribute) and not (
                isinstance(target.value, ast.Name) and target.value.id == "self"
            ):
                found.append(f"{node.lineno} {ast.unparse(target)}")
    return found


def test_the_runner_changes_no_request():
    """The runner executes a scheduled step and changes no request (the engine applies the step's
    results afterwards, so a failed forward can simply run again)."""
    runner = Path(__file__).resolve().parents[1] / "src" / "gptoss_lite" / "engine" / "runner.py"
    assert runner_request_writes(runner.read_text()) == []
    assert runner_request_writes("def f(self, request):\n    request.num_computed = 3\n    self.x = 1\n") == [
        "2 request.num_computed"
    ]


def llm_method(name: str) -> ast.FunctionDef:
    """The AST of method `name` of engine/llm.py's LLM."""
    engine = Path(__file__).resolve().parents[1] / "src" / "gptoss_lite" / "engine"
    tree = ast.parse((engine / "llm.py").read_text())
    (method,) = [
        node
        for cls in tree.body
        if isinstance(cls, ast.ClassDef) and cls.name == "LLM"
        for node in cls.body
        if isinstance(node, ast.FunctionDef) and node.name == name
    ]
    return method


def test_llm_step_is_schedule_execute_postprocess():
    """LLM.step changes no request itself: the scheduler's postprocess applies a step's results."""
    step = llm_method("step")
    assert runner_request_writes(ast.unparse(step)) == []
    calls = [ast.unparse(n.func) for n in ast.walk(step) if isinstance(n, ast.Call)]
    for call in ("self.scheduler.schedule", "self._execute", "self.scheduler.postprocess"):
        assert call in calls, call


def test_llm_init_is_short():
    """LLM.__init__ stays at most 30 lines: the knobs and their checks live in EngineConfig, the setup
    in named helpers."""
    init = llm_method("__init__")
    assert init.end_lineno - init.lineno + 1 <= 30
