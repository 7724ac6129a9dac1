"""The inside of one python-tool interpreter: pid 1 builds the sandbox, a forked child runs the cells.

`python_tool.py` starts this file as a script, `python -I -u python_sandbox.py CONFIG_JSON`, inside
the namespaces that `unshare` or `bwrap` made (or, with `sandbox="none"`, in none). It imports the
standard library only, so that it starts in tens of milliseconds and trusts no site-packages code
before the walls are up.

Pid 1 (this process, first):

1. `unshare` mode: builds a new root on a tmpfs with read-only binds of the system and Python
   directories, a fresh `/proc`, a `/dev` holding only null, zero, full, random and urandom, and the
   owner's host directory bound read-write at `/mnt/data`; then `pivot_root`s into it and detaches
   the old root. (`bwrap` mode: bubblewrap did the same from its arguments.)
2. Every other mount is remounted read-only (procfs and devpts excepted: they hold no files to create).
3. Bounds processes with the pid namespace (`pid_max`, `ns_last_pid`: exactly `max_processes` pids
   are left) and RLIMIT_NPROC, and forbids nested user and mount namespaces.
4. Sets RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NPROC, RLIMIT_CORE=0, then drops every capability, locks the
   securebits (uid 0 gains none back on exec) and sets no_new_privs.
5. Checks what it built (writable mounts, capabilities, network interfaces), sends that report to the
   host, forks the interpreter and reaps processes until the interpreter exits or the host goes.

The interpreter (the child) reads one JSON request a line on the request pipe and answers one JSON
line on the reply pipe; the code's stdout and stderr are its fd 1 and 2, a pipe the host reads while
the cell runs. Requests: `{"code", "cpu_seconds", "max_bytes"}`; replies: `{"value"}` (the repr of
the last expression, as Jupyter shows it) and/or `{"error"}` (a traceback).
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import json
import linecache
import math
import os
import platform
import re
import resource
import select
import signal
import stat
import sys
import time
import traceback

# <sys/mount.h>
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 21
MNT_DETACH = 2
# statvfs f_flag bits and the mount flags they stand for: a remount inside a user namespace must
# repeat the flags the parent namespace locked (nosuid, nodev, noexec, atime), or it fails with EPERM.
_ST_TO_MS = (
    (2, MS_NOSUID),
    (4, MS_NODEV),
    (8, MS_NOEXEC),
    (1024, MS_NOATIME),
    (2048, MS_NODIRATIME),
    (4096, MS_RELATIME),
)
ST_RDONLY = 1
# <linux/prctl.h>, <linux/securebits.h>, <linux/capability.h>
PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 28, 38, 47, 4
PR_SET_CHILD_SUBREAPER = 36
# NOROOT, NO_SETUID_FIXUP, NO_CAP_AMBIENT_RAISE and the locks of all four kinds (KEEP_CAPS stays off).
SECUREBITS = 0b1110_1111
CAPABILITY_VERSION_3 = 0x20080522
# pivot_root has no glibc wrapper; the syscall number by machine (asm/unistd.h of each).
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
# The kernel allocates pids from RESERVED_PIDS (300) once a namespace's counter has passed it
# (kernel/pid.c), so pid_max = 300 + N with ns_last_pid = 300 leaves exactly N pids.
RESERVED_PIDS = 300
# Devices the code may open (bound from the host one by one; never the host's whole /dev, whose disk
# nodes a uid-0 sandbox could write through a read-only mount).
DEVICES = ("null", "zero", "full", "random", "urandom")
# Files inside a bound /etc that only root may read: covered by /dev/null.
SECRET_FILES = ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-")
# How long the interpreter waits, after a cell, for the processes that cell left to be killed and reaped.
STRAY_WAIT_S = 2.0
# Where the new root's tmpfs may be mounted: the first existing directory that holds no bind source.
ROOT_CANDIDATES = ("/mnt", "/media", "/srv", "/opt", "/tmp")

_libc = ctypes.CDLL(None, use_errno=True)


def _call(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _b(s: str | None) -> bytes | None:
    return None if s is None else os.fsencode(s)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _call(_libc.mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data)), f"mount {target}")


def prctl(option: int, arg: int = 0, arg3: int = 0) -> None:
    c = ctypes.c_ulong
    _call(_libc.prctl(ctypes.c_int(option), c(arg), c(arg3), c(0), c(0)), f"prctl {option}")


def mount_points() -> list[tuple[str, str]]:
    """(mount point, file system type) of every mount this process sees, in mount order."""
    out = []
    for line in open("/proc/self/mountinfo"):
        fields, fstype = line.split(" - ")
        # mountinfo escapes space, tab, newline and backslash as octal (\040)
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields.split()[4])
        out.append((point, fstype.split()[0]))
    return out


def remount_readonly(point: str) -> None:
    """Make the mount at `point` read-only, keeping the flags its parent namespace locked."""
    f_flag = os.statvfs(point).f_flag
    if f_flag & ST_RDONLY:
        return
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY
    for st, ms in _ST_TO_MS:
        if f_flag & st:
            flags |= ms
    mount(None, point, None, flags)


def writable_mounts(keep: tuple[str, ...]) -> list[str]:
    """Mount points one can write through, other than `keep` and file systems with no files to create."""
    out = []
    for point, fstype in mount_points():
        if point in keep or fstype in ("proc", "devpts") or not os.path.exists(point):
            continue
        if stat.S_ISCHR(os.stat(point).st_mode):  # a device bound alone (/dev/null): no file to write
            continue
        if not os.statvfs(point).f_flag & ST_RDONLY:  # statvfs sees the topmost mount at the path
            out.append(point)
    return sorted(set(out))


def build_root(data_dir: str, ro_paths: list[str]) -> None:
    """`unshare` mode: a tmpfs root with `ro_paths` bound, /proc, a small /dev and /mnt/data; pivot into it."""
    sources = [data_dir, *ro_paths]
    new = next(
        (d for d in ROOT_CANDIDATES if os.path.isdir(d) and not any(s == d or s.startswith(d + "/") for s in sources)),
        None,
    )
    if new is None:
        raise OSError(f"no directory to mount the new root on: each of {ROOT_CANDIDATES} is missing or a bind source")
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for src in ro_paths:
        dst = new + src
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.islink(src):  # /bin -> usr/bin on merged-/usr systems: the same link, not a second bind
            os.symlink(os.readlink(src), dst)
            continue
        if os.path.isdir(src):
            os.makedirs(dst, exist_ok=True)
        else:
            open(dst, "w").close()
        mount(src, dst, None, MS_BIND | MS_REC)
    os.makedirs(new + "/mnt/data")
    mount(data_dir, new + "/mnt/data", None, MS_BIND)
    os.makedirs(new + "/dev")
    mount("tmpfs", new + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for name in DEVICES:
        open(f"{new}/dev/{name}", "w").close()
        mount(f"/dev/{name}", f"{new}/dev/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1")):
        os.symlink(target, f"{new}/dev/{name}")
    os.symlink("/proc/self/fd/2", f"{new}/dev/stderr")
    os.makedirs(new + "/dev/shm")
    for path in SECRET_FILES:
        if os.path.isfile(new + path):
            mount(f"{new}/dev/null", new + path, None, MS_BIND)
    os.makedirs(new + "/proc")
    mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(new + "/tmp", exist_ok=True)  # already there when Python itself lives under /tmp (a venv)
    os.makedirs(new + "/.oldroot")
    number = PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(f"pivot_root: syscall number unknown on {platform.machine()} (known: {sorted(PIVOT_ROOT)})")
    os.chdir(new)
    _call(_libc.syscall(ctypes.c_long(number), b".", b".oldroot"), "pivot_root")
    os.chdir("/")
    _call(_libc.umount2(b"/.oldroot", ctypes.c_int(MNT_DETACH)), "umount /.oldroot")
    os.rmdir("/.oldroot")


def bound_processes(max_processes: int) -> int | None:
    """Leave exactly `max_processes` pids in this pid namespace; the pid_max set, or None where the kernel
    keeps pid_max global (before Linux 6.14)."""
    try:
        with open("/proc/sys/kernel/pid_max", "w") as f:
            f.write(str(RESERVED_PIDS + max_processes))
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(RESERVED_PIDS))
    except OSError:
        return None
    return RESERVED_PIDS + max_processes


def forbid_namespaces() -> list[str]:
    """No nested user or mount namespaces (a nested user namespace could mount tmpfs, which no rlimit bounds)."""
    done = []
    for name in ("max_user_namespaces", "max_mnt_namespaces"):
        try:
            with open(f"/proc/sys/user/{name}", "w") as f:
                f.write("0")
            done.append(name)
        except OSError:
            pass
    return done


def drop_capabilities() -> None:
    """No capabilities, now or after any exec, and no way back (securebits locked, no_new_privs)."""
    prctl(PR_SET_SECUREBITS, SECUREBITS)
    last = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last + 1):
        prctl(PR_CAPBSET_DROP, cap)
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    _call(_libc.capset(ctypes.byref(Header(CAPABILITY_VERSION_3, 0)), (Data * 2)()), "capset")
    prctl(PR_SET_NO_NEW_PRIVS, 1)


def capabilities() -> dict[str, int]:
    return {k: int(v, 16) for k, v in (line.split(":") for line in open("/proc/self/status")) if k.startswith("Cap")}


def set_limits(limits: dict) -> None:
    for name, value in (
        ("RLIMIT_AS", limits["memory_bytes"]),
        ("RLIMIT_FSIZE", limits["max_file_bytes"]),
        ("RLIMIT_NPROC", limits["max_processes"]),
        ("RLIMIT_CORE", 0),
    ):
        resource.setrlimit(getattr(resource, name), (value, value))


def setup(cfg: dict) -> dict:
    """Pid 1's work before the interpreter starts; returns the report the host checks."""
    mode, limits = cfg["mode"], cfg["limits"]
    report: dict = {"mode": mode}
    if mode == "none":
        os.chdir(cfg["data_dir"])
        set_limits(limits)
        prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of the code stay ours to reap
        report["cwd"] = os.getcwd()
        return report
    if mode == "unshare":
        build_root(cfg["data_dir"], cfg["ro_paths"])
    if mode == "bwrap":
        loopback_down()  # bwrap brings `lo` up; the code gets no network at all, loopback included
    report["pid_max"] = bound_processes(limits["max_processes"])  # before /proc is read-only
    report["forbidden"] = forbid_namespaces()
    for point, _ in mount_points():
        if point != "/mnt/data" and os.path.exists(point):
            try:
                remount_readonly(point)
            except OSError:
                pass  # reported below through writable_mounts
    set_limits(limits)
    drop_capabilities()
    os.chdir("/mnt/data")
    report["cwd"] = os.getcwd()
    report["writable"] = writable_mounts(keep=("/mnt/data",))
    report["capabilities"] = capabilities()
    report["interfaces_up"] = interfaces_up()
    return report


def loopback_down() -> None:
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", 0))  # SIOCSIFFLAGS: no IFF_UP


def interfaces_up() -> list[str]:
    """The network interfaces that are up (a fresh network namespace has only `lo`, and it is down)."""
    import fcntl
    import socket
    import struct

    names = [line.split(":")[0].strip() for line in open("/proc/self/net/dev").readlines()[2:]]
    up = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            answer = fcntl.ioctl(s, 0x8913, struct.pack("16sH", name.encode(), 0))  # SIOCGIFFLAGS
            if struct.unpack("16sH", answer)[1] & 1:  # IFF_UP
                up.append(name)
    return up


# ---- the interpreter (the forked child) ----


def _trimmed_traceback(err: BaseException, max_bytes: int) -> str:
    """The traceback from the cell's first frame on (the interpreter's own frames are no news to the model)."""
    tb = err.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell"):
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(err), err, tb))
    return _cut(text, max_bytes)


def _cut(text: str, max_bytes: int) -> str:
    data = text.encode("utf-8", "backslashreplace")
    if len(data) <= max_bytes:
        return text
    return data[:max_bytes].decode("utf-8", "replace") + f"\n[cut: {len(data):,} bytes, the first {max_bytes:,} kept]"


def run_cell(code: str, namespace: dict, number: int, max_bytes: int) -> dict:
    """Execute one cell like a Jupyter kernel: the statements, then the repr of a final expression
    (unless the cell ends with ';'). Any exception, SystemExit included, comes back as a traceback."""
    filename = f"<cell {number}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)  # source lines in tracebacks
    try:
        tree = ast.parse(code, filename)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr) and not code.rstrip().endswith(";"):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, filename, "exec"), namespace)
        if last is None:
            return {}
        value = eval(compile(last, filename, "eval"), namespace)
        if value is None:
            return {}
        namespace["_"] = value
        return {"value": _cut(repr(value), max_bytes)}
    except BaseException as err:  # noqa: BLE001 - the code's exceptions are its output, whatever they are
        return {"error": _trimmed_traceback(err, max_bytes)}
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # the code closed or broke its own stream
                pass


def end_strays(me: int) -> None:
    """Kill every process of the sandbox but pid 1 and this one (`me`), and wait until they are gone.

    Killed orphans stay zombies until pid 1 reaps them, holding pids: so kill again (a process may
    have forked meanwhile), reap this process's own children, and look at /proc until it lists
    nothing else, for at most STRAY_WAIT_S. /proc lists processes, not threads, so this interpreter's
    own threads never count.

    NOTE: kill(-1) reaches every process the caller may signal; only inside a pid namespace is that
    the sandbox alone. Never call it with sandbox="none".
    """
    deadline = time.monotonic() + STRAY_WAIT_S
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            return  # nothing else to signal: no process left, zombies included
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        left = [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.002)


def serve(request_fd: int, reply_fd: int, namespaced: bool) -> None:
    """The interpreter's loop: one request line in, one reply line out, until the request pipe closes.
    With `namespaced`, processes the code started do not outlive its cell (a fork bomb ends with it)."""
    for fd in (request_fd, reply_fd):
        os.set_inheritable(fd, False)  # the code's subprocesses get neither end
    # A process the code forks is a copy of this loop: it must neither read a request nor answer one, nor
    # hold the reply pipe open (the host reads its end of file as "the interpreter died").
    me = os.getpid()

    def close_pipes() -> None:
        for fd in (request_fd, reply_fd):
            try:
                os.close(fd)
            except OSError:  # a grandchild: its parent closed them already
                pass

    os.register_at_fork(after_in_child=close_pipes)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(encoding="utf-8", errors="backslashreplace")
    sys.path.insert(0, os.getcwd())  # like a notebook: modules written to /mnt/data can be imported
    sys.argv = [""]
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    buffer, number = b"", 0
    while True:
        while b"\n" not in buffer:
            chunk = os.read(request_fd, 1 << 16)
            if not chunk:
                return
            buffer += chunk
        line, buffer = buffer.split(b"\n", 1)
        request = json.loads(line)
        number += 1
        used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        soft = math.ceil(used + request["cpu_seconds"])  # RLIMIT_CPU counts whole seconds
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        reply = run_cell(request["code"], namespace, number, request["max_bytes"])
        if os.getpid() != me:  # a child the cell forked has finished the cell: its work is done
            os._exit(0)
        if namespaced:
            end_strays(me)
        os.write(reply_fd, json.dumps(reply).encode() + b"\n")


def main() -> int:
    cfg = json.loads(sys.argv[1])
    request_fd, reply_fd = cfg["request_fd"], cfg["reply_fd"]
    try:
        report = setup(cfg)
    except Exception as err:  # noqa: BLE001 - any failure to build the sandbox goes to the host as text
        os.write(reply_fd, json.dumps({"fatal": f"{type(err).__name__}: {err}"}).encode() + b"\n")
        return 1
    os.write(reply_fd, json.dumps({"ready": report}).encode() + b"\n")
    child = os.fork()
    if child == 0:
        try:
            serve(request_fd, reply_fd, namespaced=cfg["mode"] != "none")
        finally:
            os._exit(0)
    os.close(reply_fd)  # the host sees EOF as soon as the interpreter is gone
    return reap(child, request_fd)


def reap(child: int, request_fd: int) -> int:
    """Wait for the interpreter, reaping every orphan of the code meanwhile (pid 1's duty: a zombie holds
    one of the few pids); its exit status (128 + signal if killed). POLLHUP on the request pipe means the
    host is gone: return, and the kernel kills whatever is left in the pid namespace. poll() reports
    POLLHUP even when asked for no events, so pid 1 never reads a request meant for the interpreter."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD writes to the wakeup fd
    watch = select.poll()
    watch.register(request_fd, 0)
    watch.register(wake_r, select.POLLIN)
    while True:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return 0
            if pid == 0:
                break
            if pid == child:
                return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        for fd, _ in watch.poll():
            if fd == request_fd:
                return 0
            os.read(wake_r, 4096)


if __name__ == "__main__":
    sys.exit(main())
