"""What the python tool's sandbox costs: start-up of an interpreter, a trivial call, memory per idle
interpreter, for each sandbox this machine has, against sandbox="none" (a bare subprocess).

    python benchmarks/python_tool.py [--interpreters 10] [--calls 200] [--json PATH]

Start-up: the wall time of the first call of a new owner, `pass` (the sandbox is built, the
interpreter forked, the call run), over --interpreters owners; the pool's own construction (which
starts and checks one sandbox) is timed separately. Trivial call: `pass` in an interpreter that is
already running, over --calls calls. Memory: proportional set size (PSS, shared pages split among
the processes that map them) of each interpreter's whole process tree (unshare or bwrap, pid 1, the
interpreter) with --interpreters idle, divided by their number. Medians and 90th percentiles.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import time

from gptoss_lite.tools.python_tool import Limits, PythonToolPool, SandboxUnavailable


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (from /proc/PID/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def pss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))


def quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median": statistics.median(xs), "p90": xs[int(0.9 * (len(xs) - 1))]}


def measure(sandbox: str, interpreters: int, calls: int) -> dict:
    start = time.perf_counter()
    pool = PythonToolPool(max_interpreters=interpreters, sandbox=sandbox, limits=Limits())
    construct = time.perf_counter() - start
    with pool:
        startup = [pool.run(f"owner-{i}", "pass").elapsed_s for i in range(interpreters)]
        trivial = [pool.run("owner-0", "pass").elapsed_s for _ in range(calls)]
        processes = [it.proc.pid for it in pool._interpreters.values()]
        pss = [sum(pss_bytes(p) for p in tree(pid)) for pid in processes]
        return {
            "sandbox": pool.sandbox,
            "isolation": pool.isolation,
            "construct_s": construct,
            "startup_s": quantiles(startup),
            "trivial_call_s": quantiles(trivial),
            "pss_per_interpreter_bytes": statistics.median(pss),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interpreters", type=int, default=10, help="owners started, each one interpreter (10)")
    parser.add_argument("--calls", type=int, default=200, help="trivial calls timed (200)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    rows = []
    for sandbox in ("none", "unshare", "bwrap"):
        if sandbox != "none" and shutil.which(sandbox) is None:
            print(f"{sandbox}: not installed, skipped")
            continue
        try:
            rows.append(measure(sandbox, args.interpreters, args.calls))
        except SandboxUnavailable as err:
            print(f"{sandbox}: {err}")
    header = ("sandbox", "pool start", "start-up median / p90", "trivial call median / p90", "PSS/interp")
    print(f"{header[0]:8} {header[1]:>10} {header[2]:>22} {header[3]:>26} {header[4]:>10}")
    for r in rows:
        s, c = r["startup_s"], r["trivial_call_s"]
        print(
            f"{r['sandbox']:8} {r['construct_s'] * 1e3:8.0f}ms {s['median'] * 1e3:12.0f} / {s['p90'] * 1e3:4.0f} ms"
            f" {c['median'] * 1e6:14.0f} / {c['p90'] * 1e6:5.0f} us {r['pss_per_interpreter_bytes'] / 2**20:7.1f}MiB"
        )
    if args.json:
        machine = {"machine": platform.machine(), "kernel": platform.release(), "cpus": os.cpu_count()}
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
