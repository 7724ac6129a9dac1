"""The package's public names (gptoss_lite/__init__.py)."""

import subprocess
import sys

import gptoss_lite

SCRIPT = """
import importlib, pkgutil, types
import gptoss_lite
for info in pkgutil.walk_packages(gptoss_lite.__path__, "gptoss_lite."):
    importlib.import_module(info.name)
from gptoss_lite import generate, stream_generate, generate_reference, GPTOSS, load_model, KVCache
assert isinstance(generate, types.FunctionType), type(generate)
assert generate.__module__ == "gptoss_lite.generation"
for name in gptoss_lite.__all__:
    assert not isinstance(getattr(gptoss_lite, name), types.ModuleType), name
print("ok")
"""


def test_public_names_are_not_shadowed_by_submodules():
    """After every submodule is imported, `from gptoss_lite import generate` (and every name in
    __all__) is still the function or class, never a module (fresh interpreter)."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_unknown_attribute_names_itself():
    """A missing attribute raises AttributeError naming it."""
    try:
        gptoss_lite.no_such_name  # noqa: B018
    except AttributeError as err:
        assert "no_such_name" in str(err)
    else:
        raise AssertionError("expected AttributeError")
