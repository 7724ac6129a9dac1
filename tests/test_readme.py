"""The README's Python example runs as printed."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_python_api_example_prints_what_the_readme_says():
    """The ```python block of the README's "Python API" section runs and prints its commented output."""
    section = README.read_text().split("## Python API", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    expected = re.search(r"print\(.*\)\s+# (.*)", code).group(1).strip()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected


def test_engine_example_prints_what_the_readme_says():
    """The ```python block of the README's engine section runs and prints its commented output."""
    section = README.read_text().split("## Serving many requests", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    expected = re.search(r"print\(.*\)\s+# (.*)", code).group(1).strip()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected
