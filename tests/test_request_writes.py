"""Who writes a Request: its own methods (engine/request.py), and the scheduler's postprocess with the
helpers only it calls. Checked on the source, following calls out of `LLM.step` and every other
engine function, so a write moved into a helper (as drafting once was) is still seen."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "src" / "gptoss_lite" / "engine"

# What `self.<attr>` names in a class, where the engine keeps one object of another class.
HELD = {"scheduler": "Scheduler", "kv": "KVManager", "runner": "ModelRunner", "waiting": "TenantQueues"}
MUTATORS = {"append", "extend", "clear", "pop", "insert", "remove", "update", "add", "discard"}

Function = tuple[str, str]  # (class name, or the module's file name for a module-level function; name)


def request_attributes(source: str) -> set[str]:
    """Every attribute a Request (and its RequestMetrics) holds: what their methods assign on self,
    and the dataclass fields."""
    names = set()
    for cls in ast.parse(source).body:
        if isinstance(cls, ast.ClassDef) and cls.name in ("Request", "RequestMetrics"):
            for node in ast.walk(cls):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                    if isinstance(node.ctx, ast.Store):
                        names.add(node.attr)
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names.add(node.target.id)
    return names


def functions(sources: dict[str, str]) -> dict[Function, tuple[ast.FunctionDef, str]]:
    """Every function and method of the sources, with the file it is in."""
    found = {}
    for file, source in sources.items():
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef):
                found[(file, node.name)] = (node, file)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        found[(node.name, item.name)] = (item, file)
    return found


def calls(fn: ast.FunctionDef, cls: str, file: str, known: dict[Function, object]) -> set[Function]:
    """The engine functions `fn` calls: self.m(), self.<held>.m(), a module-level f() of its file."""
    out = set()
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and (file, f.id) in known:
            out.add((file, f.id))
        elif isinstance(f, ast.Attribute):
            base = f.value
            if isinstance(base, ast.Name) and base.id == "self":
                out.add((cls, f.attr))
            elif isinstance(base, ast.Attribute) and base.attr in HELD:
                out.add((HELD[base.attr], f.attr))
    return {c for c in out if c in known}


def writes(fn: ast.FunctionDef, attrs: set[str]) -> list[str]:
    """Assignments, deletions and mutating calls on a request attribute of anything but `self`."""
    found = []

    def request_attr(target: ast.expr) -> bool:
        while isinstance(target, ast.Subscript):
            target = target.value
        if not isinstance(target, ast.Attribute) or target.attr not in attrs:
            return False
        return not (isinstance(target.value, ast.Name) and target.value.id == "self")

    for node in ast.walk(fn):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets = [node.func.value]
        found += [f"{node.lineno} {ast.unparse(t)}" for t in targets if request_attr(t)]
    return found


def check(sources: dict[str, str], request_source: str) -> list[str]:
    """What breaks the rule, as 'Class.function: line target' (empty when it holds)."""
    attrs = request_attributes(request_source)
    known = functions(sources)
    graph = {key: calls(fn, key[0], file, known) for key, (fn, file) in known.items()}

    def reach(start: Function) -> set[Function]:
        seen, todo = {start}, [start]
        while todo:
            for callee in graph[todo.pop()]:
                if callee not in seen:
                    seen.add(callee)
                    todo.append(callee)
        return seen

    postprocess = reach(("Scheduler", "postprocess"))
    from_step = reach(("LLM", "step"))
    broken = []
    if ("Scheduler", "postprocess") not in from_step:
        broken.append("LLM.step does not reach Scheduler.postprocess")
    for key, (fn, _) in known.items():
        found = writes(fn, attrs)
        if not found:
            continue
        callers = {caller for caller, callees in graph.items() if key in callees}
        where = "reached from LLM.step" if key in from_step else "outside the step"
        root = key == ("Scheduler", "postprocess")  # called by the step; its helpers only by it
        if key not in postprocess or not (root or callers <= postprocess):
            broken += [f"{key[0]}.{key[1]} ({where}): {w}" for w in found]
    return sorted(broken)


def engine_sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(ENGINE.glob("*.py")) if p.name != "request.py"}


def test_a_request_is_written_only_by_its_methods_and_the_scheduler_postprocess():
    broken = check(engine_sources(), (ENGINE / "request.py").read_text())
    assert broken == [], broken


REQUEST = """
class Request:
    def __init__(self):
        self.draft = []
        self.num_computed = 0
"""

ENGINE_SKETCH = """
class LLM:
    def step(self):
        self._propose()
        self.scheduler.schedule()
        self.scheduler.postprocess()

    def _propose(self):
        for r in self.scheduler.running:
            r.draft = [1]

class Scheduler:
    def schedule(self):
        self._shared(None)

    def postprocess(self):
        self._finish(None)
        self._shared(None)

    def _finish(self, request):
        request.num_computed += 1
        request.draft.append(2)

    def _shared(self, request):
        del request.draft[1:]
"""


def test_the_rule_follows_calls_out_of_the_step():
    """A write in a helper the step calls is seen (the old check read only step's own body), and so is
    a write in a postprocess helper that schedule() calls too."""
    assert check({"llm.py": ENGINE_SKETCH}, REQUEST) == [
        "LLM._propose (reached from LLM.step): 10 r.draft",
        "Scheduler._shared (reached from LLM.step): 25 request.draft[1:]",
    ]
