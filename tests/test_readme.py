"""The README's examples run as printed, its commands parse, and it stays a front page."""

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gptoss_lite.cli import build_parser

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


MAX_LINES = 250  # the README is a front page; the long matter lives in docs/


def test_readme_is_a_front_page():
    """The README stays at most MAX_LINES lines: measured tables, caveats and history go to docs/."""
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines (at most {MAX_LINES}): move the long matter to docs/"


def _shell_lines(text: str) -> list[str]:
    """The command lines of a Markdown text: every line of its ```bash blocks, the `$ ` lines of its
    ```console blocks (continuation backslashes joined), and inline code spans that start a command."""
    out, fence, pending = [], None, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = line.lstrip()[3:].strip() if fence is None else None
            continue
        if fence is None:
            out += [m for m in re.findall(r"`([^`]+)`", line) if m.startswith("gptoss-lite ")]
            continue
        if fence == "console":
            if not (pending or line.startswith("$ ")):
                continue
            line = line if pending else line[2:]
        elif fence != "bash":
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    return out


def _cli_invocations(text: str) -> list[list[str]]:
    """argv (after `gptoss-lite`) of every `gptoss-lite ...` command among the command lines of `text`."""
    argvs = []
    for line in _shell_lines(text):
        segment: list[str] = []
        for token in [*shlex.split(line, comments=True), "&&"]:
            if token in ("&&", "||", "|", ";", "&"):
                if segment[:1] == ["gptoss-lite"]:
                    argvs.append(segment[1:])
                segment = []
            else:
                segment.append(token)
    return argvs


def _unknown_flags(argv: list[str]) -> list[str]:
    """Flags of argv that its subcommand does not define under exactly that name (argparse would
    otherwise accept an abbreviation the README should not teach)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    options = sub.choices[argv[0]]._option_string_actions
    return [t for t in argv[1:] if t.startswith("--") and t.split("=", 1)[0] not in options]


def test_the_readmes_cli_commands_are_real_subcommands_with_real_flags():
    """Each `gptoss-lite SUBCOMMAND ...` the README shows (bash and console blocks, inline code) parses
    with the CLI's own parser: the subcommand exists, its flags are spelled as defined, and the values
    pass their types and choices. Nothing is run."""
    argvs = _cli_invocations(README.read_text())
    assert {"generate", "passkey", "serve", "plan", "kv-bench"} <= {a[0] for a in argvs}, argvs
    bad = []
    for argv in argvs:
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            bad.append(f"gptoss-lite {shlex.join(argv)}: refused by the parser (its message is above)")
            continue
        bad += [f"gptoss-lite {shlex.join(argv)}: {flag} is not a flag of {argv[0]}" for flag in _unknown_flags(argv)]
    assert not bad, "\n".join(bad)


def test_the_command_check_reads_what_a_reader_copies(capsys):
    """The command check finds commands after `&&`, in console `$ ` lines with continuations, and in
    inline code; it refuses an unknown flag, an abbreviation and an unknown subcommand."""
    text = (
        "```bash\npip install x && gptoss-lite passkey --trials 2   # comment\n```\n"
        "```console\n$ gptoss-lite plan \\\n    --context 4096\nplan output, not a command\n```\n"
        "Run `gptoss-lite kv-bench --measured`.\n"
    )
    assert _cli_invocations(text) == [
        ["passkey", "--trials", "2"],
        ["plan", "--context", "4096"],
        ["kv-bench", "--measured"],
    ]
    assert _unknown_flags(["passkey", "--trails", "2"]) == ["--trails"]
    assert _unknown_flags(["generate", "x", "--temp", "0"]) == ["--temp"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["no-such-command"])
    capsys.readouterr()
