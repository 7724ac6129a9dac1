"""Haystack kinds for the RULER suite (docs/ruler.md#haystacks): the text that needles hide in.

Each kind yields *units* (sentences with a leading space, or lines with a leading newline) from a
seeded `random.Random`; `haystack_units` takes units until a token target is covered and cuts the
last one so the total is exact. Needles go between units.

- `noise`: the classic five sentences (grass, sky, sun, ...) in order, from a random one on.
- `sentences`: the passkey evaluator's digit-free sentences, drawn at random.
- `stdlib-docs`: docstrings of `STDLIB_MODULES`, read with `ast` from the running interpreter's
  standard library (never imported), split into sentences; a window from a random sentence on.
- `stdlib-code`: the source lines of the same files; a window from a random line on.
- `procedural`, `varied`: the training data's filler generators (`gptoss_lite.filler`).
- `train-code`: source lines of `TRAIN_STDLIB_MODULES`, a module list disjoint from `STDLIB_MODULES`,
  with every docstring removed (docstrings are prose, the kind `stdlib-docs` evaluates, which no
  training data ever holds); a window from a random line on.
- `echo`: two to five `varied` sentences drawn once, then repeated in turn, as the `noise` haystack
  repeats its five sentences (with sentences of its own).

NOTE: every kind is digit-free and ASCII: the standard library's digits are deleted (a stray number
would be a distractor the task did not ask for) and so are its few non-ASCII characters (the byte
tokenizer would otherwise cut a character in half when the last unit is cut). The stdlib kinds
depend on the Python version, which results record.
"""

from __future__ import annotations

import ast
import inspect
import random
import re
import sysconfig
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from gptoss_lite.evals.passkey import CLASSIC_FILLER, FILLER_SENTENCES
from gptoss_lite.filler import sentence_generator, varied_sentence

if TYPE_CHECKING:
    from gptoss_lite.tokenizer import Tokenizer

HAYSTACKS: tuple[str, ...] = (
    "noise",
    "sentences",
    "stdlib-docs",
    "stdlib-code",
    "procedural",
    "varied",
    "train-code",
    "echo",
)
LINE_KINDS = frozenset({"stdlib-code", "train-code"})  # units are lines; a needle becomes a line of its own

# Fixed, in this order: the stdlib haystacks must not depend on what else is installed. Modules that
# every CPython since 3.10 ships as pure-Python source (a package is read from its __init__.py).
STDLIB_MODULES: tuple[str, ...] = (
    "argparse",
    "textwrap",
    "difflib",
    "functools",
    "collections",
    "string",
    "shlex",
    "fractions",
    "heapq",
    "calendar",
    "csv",
    "dataclasses",
    "enum",
    "inspect",
    "pathlib",
    "random",
    "statistics",
    "typing",
    "json",
    "logging",
    "subprocess",
    "threading",
    "zipfile",
    "tarfile",
    "pickle",
    "email/message",
    "http/client",
    "urllib/parse",
    "unittest/case",
    "contextlib",
    "configparser",
    "optparse",
    "tempfile",
)

# The training data's code haystack (`train-code`): other pure-Python modules of every CPython since
# 3.10, none of them in STDLIB_MODULES (a test checks).
TRAIN_STDLIB_MODULES: tuple[str, ...] = (
    "ast",
    "base64",
    "bisect",
    "codecs",
    "copy",
    "glob",
    "gzip",
    "hmac",
    "ipaddress",
    "locale",
    "mimetypes",
    "numbers",
    "operator",
    "os",
    "pprint",
    "queue",
    "sched",
    "secrets",
    "selectors",
    "shutil",
    "socketserver",
    "tokenize",
    "traceback",
    "types",
    "uuid",
    "warnings",
    "weakref",
    "fnmatch",
    "graphlib",
    "linecache",
    "reprlib",
    "colorsys",
    "filecmp",
    "fileinput",
    "getopt",
    "gettext",
    "netrc",
    "pkgutil",
    "runpy",
    "smtplib",
    "ftplib",
    "poplib",
    "imaplib",
    "timeit",
    "trace",
    "tabnanny",
    "pyclbr",
    "bdb",
    "cmd",
    "code",
    "codeop",
    "dis",
    "mailbox",
    "plistlib",
    "quopri",
    "symtable",
    "wave",
    "xml/dom/minidom",
    "asyncio/tasks",
    "asyncio/queues",
    "concurrent/futures/_base",
)

_DIGITS = re.compile(r"\d")
_SPACE = re.compile(r"\s+")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def clean_text(text: str) -> str:
    """`text` with digits and non-ASCII characters deleted."""
    return _DIGITS.sub("", text.encode("ascii", "ignore").decode("ascii"))


def stdlib_file(module: str) -> Path:
    """The source file of a stdlib module (`email/message` style), in the running interpreter's library."""
    root = Path(sysconfig.get_path("stdlib"))
    for path in (root / f"{module}.py", root / module / "__init__.py"):
        if path.is_file():
            return path
    raise ValueError(
        f"stdlib module {module!r}: no {module}.py or {module}/__init__.py under {root}; this Python "
        "does not ship its standard library as source, so the stdlib haystacks are unavailable"
    )


def docstrings(tree: ast.AST) -> Iterator[ast.Expr]:
    """The docstring statements of a module, its classes and functions, in `ast.walk` order (the
    statements `ast.get_docstring` reads)."""
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            yield first


@cache
def stdlib_docs() -> tuple[str, ...]:
    """Sentences (leading space) of the docstrings of STDLIB_MODULES, in file and `ast.walk` order."""
    units = []
    for module in STDLIB_MODULES:
        path = stdlib_file(module)
        for expr in docstrings(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            text = _SPACE.sub(" ", clean_text(inspect.cleandoc(expr.value.value))).strip()
            units.extend(" " + s for s in _SENTENCE_END.split(text) if s.strip(" .,:;-"))
    return tuple(units)


@cache
def stdlib_code() -> tuple[str, ...]:
    """Non-blank source lines (leading newline) of STDLIB_MODULES, in order."""
    units = []
    for module in STDLIB_MODULES:
        for line in clean_text(stdlib_file(module).read_text(encoding="utf-8")).splitlines():
            if line.strip():
                units.append("\n" + line.rstrip())
    return tuple(units)


@cache
def train_code() -> tuple[str, ...]:
    """Non-blank source lines (leading newline) of TRAIN_STDLIB_MODULES without their docstrings, in
    order; a line holding an eval label or value word is dropped too."""
    from gptoss_lite.evals.ruler_splits import EVAL

    banned = re.compile(r"(?i)" + "|".join(EVAL.labels + EVAL.words))
    units = []
    for module in TRAIN_STDLIB_MODULES:
        path = stdlib_file(module)
        source = path.read_text(encoding="utf-8")
        skip = {n for expr in docstrings(ast.parse(source, str(path))) for n in range(expr.lineno, expr.end_lineno + 1)}
        for number, line in enumerate(source.splitlines(), start=1):
            line = clean_text(line)
            if number not in skip and line.strip() and not banned.search(line):
                units.append("\n" + line.rstrip())
    return tuple(units)


def unit_stream(kind: str, rng: random.Random) -> Callable[[], str]:
    """A function returning the next unit of `kind`, all randomness drawn from `rng`."""
    if kind in ("noise", "stdlib-docs", "stdlib-code", "train-code", "echo"):
        if kind == "echo":
            corpus = tuple(varied_sentence(rng) for _ in range(rng.randint(2, 5)))
        else:
            corpus = {
                "noise": lambda: CLASSIC_FILLER,
                "stdlib-docs": stdlib_docs,
                "stdlib-code": stdlib_code,
                "train-code": train_code,
            }[kind]()
        position = [rng.randrange(len(corpus))]

        def window() -> str:
            unit = corpus[position[0] % len(corpus)]
            position[0] += 1
            return unit

        return window
    if kind == "sentences":
        return lambda: rng.choice(FILLER_SENTENCES)
    if kind in ("procedural", "varied"):
        sentence = sentence_generator(kind)
        return lambda: sentence(rng)
    raise ValueError(f"haystack {kind!r}: must be one of {HAYSTACKS}")


def haystack_units(kind: str, rng: random.Random, n_tokens: int, tokenizer: Tokenizer) -> list[str]:
    """Units of `kind` totalling `n_tokens` tokens (each unit encoded alone; the last one is cut at a
    token boundary, so with the byte tokenizer the total is exact)."""
    if n_tokens < 0:
        raise ValueError(f"n_tokens={n_tokens}: must be >= 0")
    nxt = unit_stream(kind, rng)
    units: list[str] = []
    used = 0
    while used < n_tokens:
        ids = tokenizer.encode(nxt())
        if used + len(ids) > n_tokens:
            ids = ids[: n_tokens - used]
        units.append(tokenizer.decode(ids))
        used += len(ids)
    return units
