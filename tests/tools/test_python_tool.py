"""The python tool's pool: Jupyter-like results, state per owner, and every limit ends in a tool error
that leaves the pool usable. Runs wherever a sandbox can be had (unprivileged user namespaces or
bubblewrap); elsewhere the sandboxed tests skip and say why."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gptoss_lite.tools import python_tool
from gptoss_lite.tools.python_tool import Limits, PythonToolPool, SandboxUnavailable, ToolResult

REPO = Path(__file__).resolve().parents[2]
# Small on purpose: the fork bomb below meets these, and must not hurt the machine that runs the tests.
LIMITS = Limits(wall_seconds=20, cpu_seconds=20, memory_bytes=1 << 30, max_processes=16, max_file_bytes=1 << 20)


def _pool(**kwargs) -> PythonToolPool:
    try:
        return PythonToolPool(**{"limits": LIMITS, **kwargs})
    except SandboxUnavailable as err:
        pytest.skip(f"no sandbox on this machine: {err}")


@pytest.fixture(scope="module")
def pool():
    with _pool() as p:
        yield p


def pids(pool: PythonToolPool, owner: str) -> list[int]:
    result = pool.run(owner, "import os; sorted(int(p) for p in os.listdir('/proc') if p.isdigit())")
    assert not result.error, result.text
    return eval(result.text)


def test_a_python_that_lives_under_tmp(tmp_path):
    """A virtual environment under /tmp (where CI makes its fresh one) is bound into the new root under
    /tmp; the root's own /tmp must then not be made a second time (it was: FileExistsError, no sandbox)."""
    if not str(tmp_path).startswith("/tmp/"):
        pytest.skip(f"the temporary directory is not under /tmp here ({tmp_path})")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    _pool().close_all()  # skips where there is no sandbox at all; from here a failure to start is a failure
    with PythonToolPool(limits=LIMITS, python=str(tmp_path / "venv" / "bin" / "python")) as under_tmp:
        assert under_tmp.run("t", "import sys; print(sys.prefix)").text == f"{tmp_path / 'venv'}\n"
        result = under_tmp.run("t", "open('/tmp/x', 'w')")
        assert result.error and ("Read-only file system" in result.text or "No such file" in result.text)


def test_print_returns_the_number(pool):
    """print(2**100) comes back as its digits, with no error."""
    result = pool.run("print", "print(2**100)")
    assert result == ToolResult("1267650600228229401496703205376\n", False, result.elapsed_s)


def test_last_expression_is_shown_like_jupyter(pool):
    """Output, then the repr of a final expression; nothing for None or a trailing ';'."""
    assert pool.run("repr", "print('a')\n[1, 'b']").text == "a\n[1, 'b']\n"
    assert pool.run("repr", "None").text == ""
    assert pool.run("repr", "3;").text == ""
    assert pool.run("repr", "_").text == "[1, 'b']\n"


def test_state_persists_per_owner_and_not_across_owners(pool):
    """A variable set in one call is read in the next call of its owner, never by another owner."""
    assert not pool.run("alice", "secret = 41").error
    assert pool.run("alice", "secret + 1").text == "42\n"
    other = pool.run("bob", "secret")
    assert other.error and "NameError" in other.text


def test_an_exception_is_a_traceback_result(pool):
    """The code's exception is tool output (error=True) naming the cell's line; the state survives."""
    pool.run("raise", "kept = 1")
    result = pool.run("raise", "def f():\n    return 1 / 0\nf()")
    assert result.error and not result.state_lost
    assert 'File "<cell 2>", line 2, in f' in result.text and "ZeroDivisionError" in result.text
    assert "python_sandbox" not in result.text  # the interpreter's own frames are left out
    assert pool.run("raise", "kept").text == "1\n"


def test_no_connection_to_this_machine(pool):
    """A server listening on the host's 127.0.0.1 cannot be reached from the sandbox."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result = pool.run("net", f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)")
    assert result.error and ("unreachable" in result.text or "timed out" in result.text), result.text
    assert pool.run("net", "1 + 1").text == "2\n"


def test_no_connection_off_the_machine(pool):
    """No interface is up, so an outside address is unreachable (no DNS either)."""
    result = pool.run("net", "import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)")
    assert result.error and ("unreachable" in result.text or "timed out" in result.text), result.text
    assert pool.run("net", "import socket; [n for _, n in socket.if_nameindex()]").text == "['lo']\n"


def test_a_fork_bomb_is_bounded_and_ends_with_its_call(pool):
    """Forking forever stops at max_processes (a clear error, in seconds) and leaves no process behind."""
    start = time.monotonic()
    result = pool.run("fork", "import os\nwhile True:\n    os.fork()", timeout=10)
    assert result.error and "Resource temporarily unavailable" in result.text, result.text
    assert time.monotonic() - start < 10
    assert len(pids(pool, "fork")) == 2  # pid 1 and the interpreter


def test_processes_do_not_outlive_their_call(pool):
    """A background process the code starts is gone when its call has ended."""
    assert not pool.run("bg", "import subprocess; p = subprocess.Popen(['sleep', '60'])").error
    assert len(pids(pool, "bg")) == 2


def test_an_endless_loop_times_out_and_the_interpreter_restarts(pool):
    """`while True: pass` ends at the wall limit with a clear error; the state is lost, and says so."""
    pool.run("spin", "kept = 1")
    start = time.monotonic()
    result = pool.run("spin", "while True: pass", timeout=2)
    assert time.monotonic() - start < 4
    assert result.error and result.state_lost
    assert "timed out after 2 s" in result.text and "variables and imports from earlier calls are gone" in result.text
    after = pool.run("spin", "kept")
    assert after.error and "NameError" in after.text


def test_the_cpu_limit_ends_a_call():
    """Past cpu_seconds of CPU time the interpreter is stopped with a clear error, before the wall limit."""
    with _pool(limits=Limits(wall_seconds=30, cpu_seconds=1, max_processes=16)) as pool:
        result = pool.run("cpu", "while True: pass")
        assert result.error and result.state_lost and "CPU time limit (1 s) exceeded" in result.text, result.text
        assert result.elapsed_s < 30
        assert pool.run("cpu", "1").text == "1\n"


def test_a_huge_allocation_is_a_memory_error(pool):
    """10 GB is past RLIMIT_AS: MemoryError, and the interpreter and its state live on."""
    pool.run("mem", "kept = 1")
    result = pool.run("mem", "b = bytearray(10 * 10**9)")
    assert result.error and "MemoryError" in result.text
    assert pool.run("mem", "kept").text == "1\n"


def test_huge_output_is_cut_with_a_note(pool):
    """100 MB of output comes back as max_output_bytes and a note of how much there was."""
    result = pool.run("out", "import sys\nfor _ in range(100): sys.stdout.write('x' * 10**6)")
    assert not result.error
    assert result.text.startswith("x" * LIMITS.max_output_bytes)
    assert len(result.text) < LIMITS.max_output_bytes + 200
    assert "output cut: 100,000,000 bytes written, the first 16,384 kept" in result.text
    assert pool.run("out", "'ok'").text == "'ok'\n"


@pytest.mark.parametrize("where", ["/tmp/gptoss-x", "HOME", "REPO", "/gptoss-x", "/etc/gptoss-x", "/dev/gptoss-x"])
def test_writing_outside_mnt_data_fails(pool, where):
    """Files can be written in /mnt/data and nowhere else: /tmp, the server's home, the repository, /."""
    path = {"HOME": str(Path.home() / "gptoss-x"), "REPO": str(REPO / "gptoss-x")}.get(where, where)
    result = pool.run("write", f"open({path!r}, 'w').write('x')")
    assert result.error and ("Read-only file system" in result.text or "No such file" in result.text), result.text
    assert not Path(path).exists()
    assert not pool.run("write", "open('/mnt/data/f', 'w').write('x'); open('f').read()").error


def test_the_file_size_limit(pool):
    """A file past max_file_bytes fails to be written (EFBIG), and the interpreter lives on."""
    result = pool.run("fsize", f"open('/mnt/data/big', 'wb').write(b'x' * {2 * LIMITS.max_file_bytes})")
    assert result.error and "File too large" in result.text
    assert pool.run("fsize", "2").text == "2\n"


def test_no_capabilities_and_no_nested_namespaces(pool):
    """The code holds no capability, cannot remount / and cannot make a user namespace of its own."""
    code = (
        "import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
        "caps = [l.split()[1] for l in open('/proc/self/status') if l.startswith('Cap')]\n"
        "remount = libc.mount(None, b'/', None, 32 | 4096, None), ctypes.get_errno()\n"  # MS_REMOUNT | MS_BIND
        "userns = libc.unshare(0x10000000), ctypes.get_errno()\n"  # CLONE_NEWUSER
        "set(caps), remount, userns"
    )
    assert pool.run("caps", code).text == "({'0000000000000000'}, (-1, 1), (-1, 28))\n"  # EPERM, ENOSPC


def test_the_pool_evicts_the_least_recently_used_interpreter():
    """At most max_interpreters live; the one evicted for room loses its state and its next call says so."""
    with _pool(max_interpreters=2) as pool:
        pool.run("a", "x = 'a'")
        pool.run("b", "x = 'b'")
        pool.run("a", "x")  # b is now the least recently used
        pool.run("c", "x = 'c'")
        assert len(pool) == 2
        assert pool.run("a", "x").text == "'a'\n"
        result = pool.run("b", "x")
        assert result.error and result.state_lost
        assert "stopped to make room for another conversation (at most 2 run at once)" in result.text
        assert "NameError" in result.text
        assert len(pool) == 2


def test_idle_interpreters_are_evicted():
    """An interpreter idle for idle_seconds is stopped; the owner's next call says so."""
    with _pool(idle_seconds=0.5) as pool:
        pool.run("a", "x = 1")
        time.sleep(0.6)
        pool.evict_idle()  # the background thread may have done it already
        assert len(pool) == 0
        result = pool.run("a", "x")
        assert result.state_lost and "stopped after 0.5 s idle" in result.text and "NameError" in result.text
        assert not pool.run("a", "x = 2").state_lost


def test_owners_run_in_parallel(pool):
    """One owner's slow call does not hold up another owner's."""
    slow = threading.Thread(target=pool.run, args=("slow", "import time; time.sleep(2)"))
    slow.start()
    time.sleep(0.2)
    start = time.monotonic()
    assert pool.run("fast", "1").text == "1\n"
    assert time.monotonic() - start < 1.5
    slow.join()


def test_close_stops_an_owner(pool):
    """close(owner) stops its interpreter (its state is gone); False when it had none."""
    pool.run("closing", "x = 1")
    assert pool.close("closing") is True
    assert pool.close("closing") is False
    assert "NameError" in pool.run("closing", "x").text


def test_refuses_to_start_without_isolation(monkeypatch, tmp_path):
    """With no unshare and no bwrap, the pool raises instead of running code unsandboxed."""
    monkeypatch.setattr(python_tool.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match=r"unshare: not installed; bwrap: not installed.*sandbox='none'"):
        PythonToolPool(root_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_an_unisolated_report_is_refused(pool):
    """A sandbox reporting a writable mount, a capability, an interface up or no process bound is refused."""
    good = {
        "mode": "unshare",
        "writable": [],
        "capabilities": {"CapEff": 0},
        "interfaces_up": [],
        "cwd": "/mnt/data",
        "pid_max": 316,
    }
    assert pool._problems(good) == []
    for change, expected in (
        ({"writable": ["/"]}, "writable outside /mnt/data"),
        ({"capabilities": {"CapEff": 1}}, "capabilities left"),
        ({"interfaces_up": ["lo"]}, "interfaces up"),
        ({"cwd": "/"}, "working directory"),
    ):
        assert any(expected in p for p in pool._problems({**good, **change})), change


def test_sandbox_none_runs_only_when_asked(tmp_path):
    """sandbox='none' runs code with no isolation, and says so."""
    with PythonToolPool(sandbox="none", limits=LIMITS, root_dir=str(tmp_path)) as pool:
        assert pool.isolation.startswith("none:")
        assert pool.run("a", "x = 3\nx").text == "3\n"
        cwd = pool.run("a", "import os; os.getcwd()").text
        assert cwd.startswith(repr(str(tmp_path))[:-1])


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
def test_bwrap_sandbox():
    """The bubblewrap sandbox isolates as unshare's does: state kept, no network, no write outside /mnt/data."""
    with _pool(sandbox="bwrap") as pool:
        assert pool.sandbox == "bwrap"
        pool.run("a", "x = 5")
        assert pool.run("a", "x").text == "5\n"
        assert pool.run("a", "open('/tmp/x', 'w')").error
        assert pool.run("a", "import socket; [n for _, n in socket.if_nameindex()]").text == "['lo']\n"
        result = pool.run("a", "import socket; socket.create_connection(('127.0.0.1', 80), timeout=1)")
        assert result.error
        assert len(pids(pool, "a")) == 2


def test_caller_mistakes_are_value_errors(pool):
    """Bad limits, sandbox names, owners and timeouts raise ValueError naming the value and the rule."""
    with pytest.raises(ValueError, match=r"wall_seconds=0: must be > 0"):
        Limits(wall_seconds=0)
    with pytest.raises(ValueError, match=r"max_processes=0: must be >= 1"):
        Limits(max_processes=0)
    with pytest.raises(ValueError, match=r"sandbox='docker': must be one of"):
        PythonToolPool(sandbox="docker")
    with pytest.raises(ValueError, match=r"max_interpreters=0: must be >= 1"):
        PythonToolPool(max_interpreters=0)
    with pytest.raises(ValueError, match=r"owner='': must be a non-empty string"):
        pool.run("", "1")
    with pytest.raises(ValueError, match=r"timeout=0: must be > 0 seconds"):
        pool.run("a", "1", timeout=0)
    with pytest.raises(TypeError, match=r"code: expected str, got bytes"):
        pool.run("a", b"1")


def test_a_closed_pool_refuses_calls(tmp_path):
    """After close_all() the pool's directory is gone and run() raises."""
    pool = _pool(root_dir=str(tmp_path))
    pool.run("a", "1")
    pool.close_all()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match=r"after close_all"):
        pool.run("a", "1")
