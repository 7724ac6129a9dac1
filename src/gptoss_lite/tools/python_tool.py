"""gpt-oss's built-in `python` tool: sandboxed, stateful Python interpreters, one per owner.

gpt-oss was trained with a `python` tool that openai-harmony's `SystemContent.with_python_tool()`
describes to the model as "a stateful Jupyter notebook environment" that answers with the output or
times out after 120 seconds, with "/mnt/data" for files. `PythonToolPool.run(owner, code)` is that
tool: the owner's interpreter runs the code and the result is what the model reads back.

    pool = PythonToolPool(max_interpreters=8, idle_seconds=900, limits=Limits(wall_seconds=120))
    pool.run("tenant/chain-1", "x = 2**100").text      # ''
    pool.run("tenant/chain-1", "x").text               # '1267650600228229401496703205376'
    pool.close_all()

Why a plain interpreter over pipes, not jupyter_client + ipykernel: a kernel talks ZMQ over TCP, so
in a network namespace it needs `lo` up, which hands the code a working loopback; it brings ipykernel,
IPython, pyzmq, tornado and traitlets into the server's dependencies; and it starts in about a second
where a bare interpreter starts in tens of milliseconds. What the model needs of Jupyter (state kept
between calls, stdout and stderr, the repr of a final expression, a traceback on error) is forty
lines of `ast` and `exec` (python_sandbox.run_cell), and pipes need no network stack at all.

Isolation (`sandbox=`): "unshare" (util-linux, unprivileged user namespaces) or "bwrap"
(bubblewrap) put each interpreter in new user, pid, network, mount, IPC and UTS namespaces, with a
new root where the system and Python directories are read-only and the owner's own directory is
`/mnt/data`, the only place it can write; no interface is up, so no connection leaves it, not even
to 127.0.0.1; it holds no capabilities. "auto" takes the first that works, in that order (bubblewrap
second: where a distribution blocks unprivileged `unshare`, e.g. Ubuntu 24.04's AppArmor default, its
bwrap profile still works). The pool starts one interpreter at construction and checks what the
sandbox reports (writable mounts, capabilities, interfaces up, the process bound); anything short of
the above raises `SandboxUnavailable`. Only `sandbox="none"`, asked for by name, runs code without
isolation. Limits: `Limits`. See docs/tools.md#the-python-tool.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SANDBOX_SCRIPT = Path(__file__).with_name("python_sandbox.py")
SANDBOXES = ("auto", "unshare", "bwrap", "none")
# System directories bound read-only into the sandbox's root (those that exist), besides the Python ones.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# What the interpreter's environment holds (the server's own environment, API keys included, stays out).
# One thread per numerical library: the pool's bound counts threads as processes.
SANDBOX_ENV = {
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
}
_READ = 1 << 16


class SandboxUnavailable(RuntimeError):
    """The asked-for isolation cannot be had here (the message says what failed and what to do)."""


@dataclass(frozen=True)
class Limits:
    """What one interpreter may use. Per call: wall and CPU time, output; per process: memory, file size."""

    wall_seconds: float = 120.0  # per call, wall clock, then the interpreter is killed (harmony tells the model 120 s)
    cpu_seconds: float = 120.0  # per call, CPU time of the interpreter (soft RLIMIT_CPU: SIGXCPU ends the call)
    memory_bytes: int = 4 << 30  # address space of each process (RLIMIT_AS), bytes
    max_processes: int = 64  # processes and threads in the sandbox (pid namespace size and RLIMIT_NPROC)
    max_file_bytes: int = 256 << 20  # largest file the code may write (RLIMIT_FSIZE), bytes
    max_output_bytes: int = 16 << 10  # stdout+stderr kept per call (and the cap on a repr or traceback), bytes
    startup_seconds: float = 30.0  # wall clock for a new interpreter to report ready

    def __post_init__(self):
        for name in ("wall_seconds", "cpu_seconds", "startup_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0 seconds")
        for name, least in (
            ("memory_bytes", 64 << 20),
            ("max_processes", 1),
            ("max_file_bytes", 1),
            ("max_output_bytes", 64),
        ):
            if getattr(self, name) < least:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= {least}")


@dataclass(frozen=True)
class ToolResult:
    """What the model reads back from one call, as a tool message."""

    text: str  # output (stdout and stderr), then the repr of a final expression or the traceback, and any note
    error: bool  # the code raised, or a limit ended it: tool output all the same, not a server error
    elapsed_s: float  # wall time of the call, the start of a fresh interpreter included
    state_lost: bool = False  # earlier variables are gone (eviction before this call, or a limit during it)


def _note(text: str) -> str:
    return f"[python: {text}]\n"


class _Interpreter:
    """One sandboxed interpreter process tree and its pipes (host side). Callers hold `lock` around call()."""

    def __init__(self, pool: PythonToolPool, data_dir: str):
        self.pool, self.data_dir = pool, data_dir
        self.lock = threading.Lock()
        self.in_use = 0  # calls running or waiting on `lock` (guarded by the pool's lock)
        self.last_used = time.monotonic()
        self.closed = False
        self.proc: subprocess.Popen | None = None
        self.report: dict = {}

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start the sandbox and wait for its report; SandboxUnavailable if it failed to isolate itself."""
        pool = self.pool
        req_r, self.req_w = os.pipe()
        self.out_r, out_w = os.pipe()
        self.rep_r, rep_w = os.pipe()
        cfg = {
            "mode": pool.sandbox,
            "data_dir": self.data_dir,
            "ro_paths": pool._ro_paths,
            "limits": asdict(pool.limits),
            "request_fd": req_r,
            "reply_fd": rep_w,
        }
        home = self.data_dir if pool.sandbox == "none" else "/mnt/data"
        env = {"PATH": f"{os.path.dirname(pool.python)}:/usr/local/bin:/usr/bin:/bin", "HOME": home, **SANDBOX_ENV}
        try:
            self.proc = subprocess.Popen(
                pool._command(self.data_dir, json.dumps(cfg)),
                stdin=subprocess.DEVNULL,
                stdout=out_w,
                stderr=out_w,
                pass_fds=(req_r, rep_w),
                env=env,
                cwd="/",
                start_new_session=True,  # one process group to kill; no signal from the server's terminal
            )
        finally:
            for fd in (req_r, out_w, rep_w):
                os.close(fd)
        for fd in (self.out_r, self.rep_r, self.req_w):
            os.set_blocking(fd, False)
        self._replies = b""
        out = _Output(pool.limits.max_output_bytes)
        reply, why = self._exchange(b"", time.monotonic() + pool.limits.startup_seconds, out)
        if reply is None or "ready" not in reply:
            self.stop()
            detail = reply["fatal"] if reply and "fatal" in reply else f"{why}; its output: {out.text()!r}"
            raise SandboxUnavailable(f"the {pool.sandbox} sandbox did not start: {detail}")
        self.report = reply["ready"]
        problems = pool._problems(self.report)
        if problems:
            self.stop()
            raise SandboxUnavailable(f"the {pool.sandbox} sandbox is not isolated: " + "; ".join(problems))

    def call(self, code: str, wall_seconds: float) -> tuple[str, bool, bool]:
        """Run one cell: (text, error, state_lost). Starts the interpreter first if there is none."""
        if self.closed:
            return _note("this interpreter was closed"), True, True
        if not self.alive:
            self.start()
        limits = self.pool.limits
        request = json.dumps({"code": code, "cpu_seconds": limits.cpu_seconds, "max_bytes": limits.max_output_bytes})
        out = _Output(limits.max_output_bytes)
        reply, why = self._exchange(request.encode() + b"\n", time.monotonic() + wall_seconds, out)
        text = out.text()
        if reply is not None:
            parts = [text] + [reply[k] for k in ("value", "error") if k in reply]
            return "\n".join(p.rstrip("\n") for p in parts if p) + "\n" * bool(any(parts)), "error" in reply, False
        if why == "timeout":
            self.stop()
            what = f"timed out after {wall_seconds:g} s (wall clock), so the interpreter was stopped"
        else:
            what = self._death()
        lost = "variables and imports from earlier calls are gone and the next call starts a fresh interpreter"
        return text + _note(f"{what}; {lost} (files in /mnt/data are kept)"), True, True

    def _death(self) -> str:
        """Why the interpreter went away by itself (its exit status, through pid 1 and unshare or bwrap)."""
        try:
            rc = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            rc = None
        self.stop()
        if rc is not None and rc > 128 and rc - 128 == signal.SIGXCPU:
            return f"CPU time limit ({self.pool.limits.cpu_seconds:g} s) exceeded, so the interpreter was stopped"
        if rc is not None and rc > 128:
            return f"the interpreter was killed by {signal.Signals(rc - 128).name}"
        return f"the interpreter exited (status {rc})"

    def _exchange(self, request: bytes, deadline: float, out: _Output) -> tuple[dict | None, str]:
        """Write `request`, then read output until a reply line: (reply, "") or (None, "timeout" | "exited")."""
        sel = selectors.DefaultSelector()
        sel.register(self.out_r, selectors.EVENT_READ)
        sel.register(self.rep_r, selectors.EVENT_READ)
        if request:
            sel.register(self.req_w, selectors.EVENT_WRITE)
        try:
            while True:
                if b"\n" in self._replies:
                    line, self._replies = self._replies.split(b"\n", 1)
                    out.drain(self.out_r)  # all the cell wrote came before its reply
                    return json.loads(line), ""
                left = deadline - time.monotonic()
                if left <= 0:
                    return None, "timeout"
                for key, _ in sel.select(left):
                    fd = key.fd
                    if fd == self.req_w:
                        written = os.write(fd, request) if request else 0
                        request = request[written:]
                        if not request:
                            sel.unregister(fd)
                        continue
                    data = _read(fd)
                    if fd == self.out_r:
                        if data is None:
                            sel.unregister(fd)
                        else:
                            out.add(data)
                    elif data is None:
                        out.drain(self.out_r)
                        return None, "exited"
                    else:
                        self._replies += data
        except BrokenPipeError:
            return None, "exited"
        finally:
            sel.close()

    def stop(self, remove_data: bool = False) -> None:
        """Kill the whole sandbox (killing pid 1 of its pid namespace kills the rest) and close the pipes."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
            for fd in (self.out_r, self.rep_r, self.req_w):
                os.close(fd)
            self.proc = None
        if remove_data:
            self.closed = True
            shutil.rmtree(self.data_dir, ignore_errors=True)


def _read(fd: int) -> bytes | None:
    """What a non-blocking pipe holds: bytes (maybe b"" if nothing yet), None at end of file."""
    try:
        data = os.read(fd, _READ)
    except BlockingIOError:
        return b""
    return data or None


class _Output:
    """stdout+stderr of one call: the first `limit` bytes kept, the rest counted."""

    def __init__(self, limit: int):
        self.limit, self.kept, self.total = limit, bytearray(), 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        if len(self.kept) < self.limit:
            self.kept += data[: self.limit - len(self.kept)]

    def drain(self, fd: int) -> None:
        while data := _read(fd):
            self.add(data)

    def text(self) -> str:
        text = self.kept.decode("utf-8", "replace")
        if self.total > self.limit:
            text += "\n" + _note(f"output cut: {self.total:,} bytes written, the first {self.limit:,} kept")
        return text


class PythonToolPool:
    """Sandboxed, stateful Python interpreters, one per owner, at most `max_interpreters` at once.

    `owner` is an opaque key (the server passes tenant and conversation chain): an owner's calls share one
    interpreter's state, and no other owner ever sees it. An interpreter idle for `idle_seconds`, or the
    least recently used one when a new owner needs room, is stopped and its /mnt/data deleted; the owner's
    next call says so. Thread-safe: calls of different owners run in parallel, an owner's calls in turn.
    """

    def __init__(
        self,
        max_interpreters: int = 8,
        idle_seconds: float = 900.0,
        limits: Limits = Limits(),
        sandbox: str = "auto",
        *,
        python: str | None = None,
        root_dir: str | None = None,
    ):
        if max_interpreters < 1:
            raise ValueError(f"max_interpreters={max_interpreters}: must be >= 1")
        if not idle_seconds > 0:
            raise ValueError(f"idle_seconds={idle_seconds}: must be > 0")
        if sandbox not in SANDBOXES:
            raise ValueError(f"sandbox={sandbox!r}: must be one of {SANDBOXES}")
        if not isinstance(limits, Limits):
            raise TypeError(f"limits: expected Limits, got {type(limits).__name__}")
        self.max_interpreters, self.idle_seconds, self.limits = max_interpreters, idle_seconds, limits
        self.python = python or sys.executable
        self._lock = threading.Lock()
        self._interpreters: OrderedDict[str, _Interpreter] = OrderedDict()  # least recently used first
        self._lost: OrderedDict[str, str] = OrderedDict()  # owner -> why its state went, for its next call
        self._root = tempfile.mkdtemp(prefix="gptoss-python-tool-", dir=root_dir)
        self._stop = threading.Event()
        self._finalizer = weakref.finalize(self, _shutdown, self._interpreters, self._root, self._stop)
        try:
            self._ro_paths = _ro_paths(self.python)
            self._uid_zero = _kernel_uid() == 0
            self.sandbox = self._choose(sandbox)
        except BaseException:
            self._finalizer()  # nothing left behind: no directory, no thread
            raise
        if self.sandbox == "none":
            log.warning("python tool: sandbox='none': code runs with this process's user, files and network")
        threading.Thread(target=_reap_idle, args=(weakref.ref(self), self._stop), daemon=True).start()

    @property
    def isolation(self) -> str:
        """What isolates the code here, in words (as checked when the pool started)."""
        if self.sandbox == "none":
            return "none: no namespaces, rlimits only; the code's directory is a host temporary one, not /mnt/data"
        bound = "the pid namespace" + ("" if self._uid_zero else " and RLIMIT_NPROC")
        return (
            f"{self.sandbox}: user, pid, network, mount, IPC and UTS namespaces; no network interface up; "
            f"a new root, read-only but for /mnt/data; no capabilities; at most {self.limits.max_processes} "
            f"processes and threads ({bound})"
        )

    def run(self, owner: str, code: str, timeout: float | None = None) -> ToolResult:
        """Run `code` in `owner`'s interpreter (started if it has none); `timeout` overrides the wall limit."""
        if not isinstance(owner, str) or not owner:
            raise ValueError(f"owner={owner!r}: must be a non-empty string")
        if not isinstance(code, str):
            raise TypeError(f"code: expected str, got {type(code).__name__}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout={timeout}: must be > 0 seconds, or None for limits.wall_seconds")
        start = time.monotonic()
        victims: list[_Interpreter] = []
        with self._lock:
            if not self._finalizer.alive:
                raise RuntimeError("run() after close_all()")
            victims += self._take_idle(start)
            interpreter = self._interpreters.get(owner)
            if interpreter is None:
                if len(self._interpreters) >= self.max_interpreters:
                    lru = next((o for o, it in self._interpreters.items() if it.in_use == 0), None)
                    if lru is None:
                        busy = f"all {self.max_interpreters} interpreters are busy with other conversations"
                        return ToolResult(_note(f"{busy}; try again shortly"), True, time.monotonic() - start)
                    victims.append(self._interpreters.pop(lru))
                    room = f"at most {self.max_interpreters} run at once"
                    self._forget(lru, f"to make room for another conversation ({room})")
                interpreter = _Interpreter(self, tempfile.mkdtemp(dir=self._root))
                self._interpreters[owner] = interpreter
            self._interpreters.move_to_end(owner)
            interpreter.in_use += 1
            notice = self._lost.pop(owner, None)
        for victim in victims:
            victim.stop(remove_data=True)
        try:
            with interpreter.lock:
                text, error, lost = interpreter.call(code, self.limits.wall_seconds if timeout is None else timeout)
        finally:
            with self._lock:
                interpreter.in_use -= 1
                interpreter.last_used = time.monotonic()
        if notice:
            gone = "its variables and files are gone, and this call ran in a fresh one"
            text = _note(f"this conversation's interpreter was stopped {notice}; {gone}") + text
        return ToolResult(text, error, time.monotonic() - start, state_lost=lost or notice is not None)

    def close(self, owner: str) -> bool:
        """Stop `owner`'s interpreter and delete its /mnt/data; False if it had none."""
        with self._lock:
            interpreter = self._interpreters.pop(owner, None)
            self._lost.pop(owner, None)
        if interpreter is not None:
            interpreter.stop(remove_data=True)
        return interpreter is not None

    def close_all(self) -> None:
        """Stop every interpreter and delete every /mnt/data; the pool cannot be used afterwards."""
        self._finalizer()

    def evict_idle(self) -> int:
        """Stop the interpreters idle for idle_seconds or more (a background thread also does, every few
        seconds); how many were stopped."""
        with self._lock:
            victims = self._take_idle(time.monotonic())
        for victim in victims:
            victim.stop(remove_data=True)
        return len(victims)

    def __len__(self) -> int:
        """Interpreters held (started or about to be)."""
        return len(self._interpreters)

    def __enter__(self) -> PythonToolPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close_all()

    def _take_idle(self, now: float) -> list[_Interpreter]:
        idle = [o for o, it in self._interpreters.items() if it.in_use == 0 and now - it.last_used >= self.idle_seconds]
        for owner in idle:
            self._forget(owner, f"after {self.idle_seconds:g} s idle")
        return [self._interpreters.pop(o) for o in idle]

    def _forget(self, owner: str, why: str) -> None:
        self._lost[owner] = why
        while len(self._lost) > 64 * self.max_interpreters:  # bounded: the oldest owners are not told
            self._lost.popitem(last=False)

    def _command(self, data_dir: str, cfg: str) -> list[str]:
        script = [self.python, "-I", "-u", str(SANDBOX_SCRIPT), cfg]
        if self.sandbox == "none":
            return script
        if self.sandbox == "unshare":
            namespaces = ["--user", "--map-root-user", "--net", "--pid", "--fork", "--mount", "--ipc", "--uts"]
            return [shutil.which("unshare") or "unshare", *namespaces, "--kill-child", "--", *script]
        binds = []
        for path in self._ro_paths:
            binds += ["--symlink", os.readlink(path), path] if os.path.islink(path) else ["--ro-bind", path, path]
        for path in ("/etc/shadow", "/etc/gshadow"):
            if os.path.isfile(path):
                binds += ["--ro-bind", "/dev/null", path]
        return [
            shutil.which("bwrap") or "bwrap",
            # Not --disable-userns: it nests one more user namespace, whose root then owns neither the mount
            # nor the pid namespace, so pid 1 could neither remount nor bound pids (it forbids nesting itself).
            *("--unshare-all", "--unshare-user", "--uid", "0", "--gid", "0"),
            # python_sandbox.py is pid 1 (it reaps, and drops every capability itself once it built the rest)
            *("--die-with-parent", "--new-session", "--as-pid-1", "--cap-add", "ALL"),
            *binds,
            *("--ro-bind", str(SANDBOX_SCRIPT), str(SANDBOX_SCRIPT), "--dev", "/dev", "--proc", "/proc"),
            *("--bind", data_dir, "/mnt/data", "--chdir", "/mnt/data", "--"),
            *script,
        ]

    def _choose(self, sandbox: str) -> str:
        """The sandbox to use: `sandbox` itself, or for "auto" the first that works; raises SandboxUnavailable."""
        if sandbox == "none":
            return "none"
        reasons = []
        for kind in ("unshare", "bwrap") if sandbox == "auto" else (sandbox,):
            if shutil.which(kind) is None:
                reasons.append(f"{kind}: not installed")
                continue
            self.sandbox = kind
            probe = _Interpreter(self, tempfile.mkdtemp(dir=self._root))
            try:
                probe.start()
                return kind
            except SandboxUnavailable as err:
                reasons.append(f"{kind}: {err}")
            finally:
                probe.stop(remove_data=True)
        raise SandboxUnavailable(
            "no sandbox for the python tool: " + "; ".join(reasons) + ". Allow unprivileged user namespaces "
            "(Debian: sysctl kernel.unprivileged_userns_clone=1; Ubuntu 24.04: install bubblewrap, whose AppArmor "
            "profile allows them), or pass sandbox='none' to run the code without isolation."
        )

    def _problems(self, report: dict) -> list[str]:
        """What keeps a started sandbox from being isolated (empty for sandbox='none', which promises nothing)."""
        if report.get("mode") == "none":
            return []
        problems = []
        if report.get("writable"):
            problems.append(f"writable outside /mnt/data: {report['writable']}")
        if any(report.get("capabilities", {"missing": 1}).values()):
            problems.append(f"capabilities left: {report.get('capabilities')}")
        if report.get("interfaces_up"):
            problems.append(f"network interfaces up: {report['interfaces_up']}")
        if report.get("cwd") != "/mnt/data":
            problems.append(f"the working directory is {report.get('cwd')!r}, not /mnt/data")
        if report.get("pid_max") is None and self._uid_zero:
            problems.append(
                "no bound on processes: this kernel keeps pid_max global (before Linux 6.14) and "
                "RLIMIT_NPROC does not bind uid 0; run the server as another user"
            )
        return problems


def _ro_paths(python: str) -> list[str]:
    """The system directories and `python`'s prefixes (as given and resolved), minus those inside another."""
    query = "import sys, json; print(json.dumps([sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix]))"
    answer = subprocess.run([python, "-I", "-c", query], capture_output=True, text=True, check=True)
    prefixes = json.loads(answer.stdout)
    paths = [p for p in SYSTEM_PATHS if os.path.lexists(p)]
    for p in prefixes:
        paths += [p, os.path.realpath(p)]
    resolved = {p for p in paths if not os.path.islink(p)}
    out = []
    for p in dict.fromkeys(paths):
        inside = any(p != q and p.startswith(q.rstrip("/") + "/") for q in resolved)
        if not inside and p not in out:
            out.append(p)
    return out


def _kernel_uid() -> int:
    """This process's uid as the parent user namespace sees it (0 where the server runs as real root)."""
    euid = os.geteuid()
    try:
        for line in open("/proc/self/uid_map"):
            inside, outside, count = map(int, line.split())
            if inside <= euid < inside + count:
                return outside + euid - inside
    except OSError:
        pass
    return euid


def _shutdown(interpreters: OrderedDict, root: str, stop: threading.Event) -> None:
    stop.set()
    while interpreters:
        interpreters.popitem()[1].stop(remove_data=True)
    shutil.rmtree(root, ignore_errors=True)


def _reap_idle(pool_ref: weakref.ref, stop: threading.Event) -> None:
    """Evict idle interpreters every few seconds, without keeping the pool alive."""
    while True:
        pool = pool_ref()
        if pool is None:
            return
        period = min(pool.idle_seconds / 4, 30.0)
        del pool
        if stop.wait(period):
            return
        pool = pool_ref()
        if pool is not None:
            pool.evict_idle()
        del pool
