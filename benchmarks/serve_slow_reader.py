"""Does a client that stops reading grow server memory? One streaming request from a client with a
tiny receive buffer that reads one byte every --read-interval seconds, while the server's RSS, its
abort counter and its engine figures are sampled.

Acceptance target: slow reader (a 4 KB receive buffer, 1 byte per 2 s, max_tokens at the context
limit): server RSS grows <= 50 MB over 5 minutes, and the client is aborted at the configured read
timeout (`gptoss-lite serve --stalled-client-timeout SECONDS`).

The script starts `gptoss-lite serve --model lite-tiny --port <free port> --threads 1` plus every
--server-arg, sends one small request (warm-up; it also measures the prompt's length in tokens),
takes the starting RSS, then opens a raw socket with SO_RCVBUF 4096 set before connect and sends
POST /v1/completions (stream, temperature 0, ignore_eos, max_tokens = context - prompt). Every
--sample-every seconds for --duration seconds it samples VmRSS (/proc/PID/status),
`gptoss_stalled_client_aborts_total` (/metrics), `num_running` and `kv_blocks_used` (/stats), and
the connection's TCP state. The connection counts as closed by the server when the server's end of
it leaves ESTABLISHED in /proc/net/tcp (its FIN may sit behind unread data for hours), or the
client's recv returns b"" or fails; the client counts as aborted when the server's stalled-client
counter rose (a close alone may be the normal end of a response that fitted in the kernel's send
queue). Prints the samples and the summary; --json prints one JSON object instead; --plot PATH
draws RSS over time with the close and the abort marked.

    python benchmarks/serve_slow_reader.py --server-arg=--stalled-client-timeout --server-arg=120 \\
        --duration 300 --read-interval 2 --plot /tmp/slow_reader.png

Without the flag the script just measures and reports "no abort seen". Only loopback is contacted.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time

import httpx
from serve_stops import ServerProcess, check_loopback

PROMPT = "The quick brown fox jumps over the lazy dog. The pass key is 52718."
STALLED_METRIC = "gptoss_stalled_client_aborts_total"
TCP_STATES = {
    1: "ESTABLISHED",
    2: "SYN_SENT",
    3: "SYN_RECV",
    4: "FIN_WAIT1",
    5: "FIN_WAIT2",
    6: "TIME_WAIT",
    7: "CLOSE",
    8: "CLOSE_WAIT",
    9: "LAST_ACK",
    10: "LISTEN",
    11: "CLOSING",
}


def rss_bytes(pid: int) -> int | None:
    """VmRSS of `pid` in bytes (None once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def tcp_entry(local_port: int, remote_port: int) -> dict | None:
    """The kernel's view of the socket local_port -> remote_port on this machine: state and the bytes
    queued for sending (tx) and waiting to be read (rx); None if no such socket exists."""
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            lport = int(fields[1].rsplit(":", 1)[1], 16)
            rport = int(fields[2].rsplit(":", 1)[1], 16)
            if lport == local_port and rport == remote_port:
                tx, rx = (int(x, 16) for x in fields[4].split(":"))
                return {"state": TCP_STATES.get(int(fields[3], 16), fields[3]), "tx": tx, "rx": rx}
    return None


def metric_sum(text: str, name: str) -> float | None:
    """Sum over the label sets of metric `name` in Prometheus text; None if the server has no such metric."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0] == name:
            total += float(value)
            found = True
    return total if found else None


class SlowReader(threading.Thread):
    """A raw-socket client: sends `request`, then reads one byte every `interval` seconds; notes when
    the server closes the connection (see the module docstring)."""

    def __init__(self, port: int, request: bytes, interval: float, rcvbuf: int):
        super().__init__(daemon=True)
        self.port, self.request, self.interval, self.rcvbuf = port, request, interval, rcvbuf
        self.stop = threading.Event()
        self.connected = threading.Event()
        self.t0 = None  # monotonic time of connect
        self.client_port = None
        self.rcvbuf_effective = None
        self.received = bytearray()
        self.closed_at = None  # seconds from t0 to the server closing the connection
        self.closed_how = None
        self.error = None

    def _closed(self, how: str) -> None:
        self.closed_at, self.closed_how = time.monotonic() - self.t0, how

    def run(self) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)  # before connect: sets the window
            self.rcvbuf_effective = s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
            s.connect(("127.0.0.1", self.port))
            self.t0 = time.monotonic()
            self.client_port = s.getsockname()[1]
            self.connected.set()
            s.sendall(self.request)
            s.setblocking(False)
            next_read = self.t0 + self.interval
            while not self.stop.is_set():
                if time.monotonic() >= next_read:
                    next_read += self.interval
                    try:
                        byte = s.recv(1)
                        if not byte:
                            self._closed("EOF")
                            return
                        self.received += byte
                    except BlockingIOError:
                        pass  # nothing to read yet
                    except OSError as exc:
                        self._closed(type(exc).__name__)
                        return
                server_side = tcp_entry(self.port, self.client_port)
                if server_side is None or server_side["state"] != "ESTABLISHED":
                    self._closed(f"server socket {server_side['state'] if server_side else 'gone'}")
                    return
                self.stop.wait(min(0.25, self.interval))
        except OSError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.connected.set()
            s.close()


def stalled_timeout(server_args: list[str]) -> float | None:
    """The --stalled-client-timeout value among the server's flags, if given."""
    for i, arg in enumerate(server_args):
        if arg == "--stalled-client-timeout" and i + 1 < len(server_args):
            return float(server_args[i + 1])
        if arg.startswith("--stalled-client-timeout="):
            return float(arg.split("=", 1)[1])
    return None


def sample(client: httpx.Client, pid: int, t0: float, reader: SlowReader | None = None) -> dict:
    stats = client.get("/stats").json()
    metrics = client.get("/metrics").text
    server_side = tcp_entry(reader.port, reader.client_port) if reader and reader.client_port else None
    return {
        "t_s": time.monotonic() - t0,
        "rss_bytes": rss_bytes(pid),
        "stalled_aborts": metric_sum(metrics, STALLED_METRIC),
        "client_aborts": metric_sum(metrics, "gptoss_client_aborts_total"),
        "num_running": stats.get("num_running"),
        "kv_blocks_used": stats.get("kv_blocks_used"),
        "kv_blocks_cached": stats.get("kv_blocks_cached"),
        "generated_tokens": stats.get("generated_tokens"),
        "finished": stats.get("finished"),
        "engine_aborted": stats.get("aborted"),
        "tcp_state": server_side["state"] if server_side else None,
        "server_send_queue_bytes": server_side["tx"] if server_side else None,
    }


def held(s: dict) -> int | None:
    """KV blocks held by requests (used minus those only the prefix cache keeps)."""
    if s["kv_blocks_used"] is None:
        return None
    return s["kv_blocks_used"] - (s["kv_blocks_cached"] or 0)


def run(url: str, pid: int, args: argparse.Namespace) -> dict:
    port = int(url.rsplit(":", 1)[1])
    timeout = stalled_timeout(args.server_arg)
    with httpx.Client(base_url=url, timeout=60.0) as client:
        card = client.get("/v1/models").json()["data"][0]
        model, max_model_len = card["id"], card["max_model_len"]
        # Warm-up, and the prompt's length in tokens as the server counts it.
        r = client.post(
            "/v1/completions", json={"model": model, "prompt": args.prompt, "max_tokens": 1, "temperature": 0}
        )
        r.raise_for_status()
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        max_tokens = max_model_len - prompt_tokens
        if args.max_tokens is not None:
            max_tokens = min(max_tokens, args.max_tokens)
        body = {
            "model": model,
            "prompt": args.prompt,
            "stream": True,
            "temperature": 0,
            "ignore_eos": True,
            "max_tokens": max_tokens,
        }
        payload = json.dumps(body).encode()
        request = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        before = sample(client, pid, time.monotonic())
        reader = SlowReader(port, request, args.read_interval, args.rcvbuf)
        reader.start()
        reader.connected.wait(30)
        if reader.t0 is None:
            raise RuntimeError(f"the slow client could not connect: {reader.error}")
        t0 = reader.t0
        samples = [sample(client, pid, t0, reader)]
        if not args.json:
            print(
                f"{model} (context {max_model_len}): slow request with prompt {prompt_tokens} tokens, max_tokens "
                f"{max_tokens}; SO_RCVBUF asked {args.rcvbuf}, kernel reports {reader.rcvbuf_effective}; "
                f"1 byte every {args.read_interval:g} s; --stalled-client-timeout "
                f"{'not given' if timeout is None else f'{timeout:g} s'}",
                flush=True,
            )
        try:
            while True:
                if not args.json:
                    print(format_sample(samples[-1], reader), flush=True)
                next_t = samples[-1]["t_s"] + args.sample_every
                if next_t > args.duration:
                    break
                time.sleep(max(0.0, t0 + next_t - time.monotonic()))
                samples.append(sample(client, pid, t0, reader))
        finally:
            reader.stop.set()
            reader.join(5)
        # The leak check: once the client has gone (closed above) and the engine is idle, dropping the
        # prefix cache must leave every KV block free.
        leak, deadline = None, time.monotonic() + 30
        while (busy := client.get("/stats").json().get("num_running")) and time.monotonic() < deadline:
            time.sleep(0.2)
        r = client.post("/admin/reset_prefix_cache")  # open on a server without API keys
        if r.status_code == 200:
            leak = r.json().get("kv_blocks_used")
    out = summarize(args, model, max_model_len, prompt_tokens, max_tokens, timeout, before, samples, reader, leak)
    out["idle_before_reset"] = not busy
    return out


def format_sample(s: dict, reader: SlowReader) -> str:
    mb = s["rss_bytes"] / 1e6 if s["rss_bytes"] is not None else float("nan")
    aborts = "absent" if s["stalled_aborts"] is None else f"{s['stalled_aborts']:g}"
    queue = "-" if s["server_send_queue_bytes"] is None else f"{s['server_send_queue_bytes']}"
    return (
        f"t={s['t_s']:6.1f} s  RSS {mb:8.1f} MB  running {s['num_running']}  kv used {s['kv_blocks_used']} "
        f"(cached {s['kv_blocks_cached']})  generated {s['generated_tokens']}  stalled aborts {aborts}  "
        f"server socket {s['tcp_state'] or 'gone'} send queue {queue} B  client read {len(reader.received)} B"
    )


def first_time(samples: list[dict], test) -> float | None:
    """The time of the first sample for which test(sample) holds (None if none does)."""
    return next((s["t_s"] for s in samples if test(s)), None)


def summarize(args, model, max_model_len, prompt_tokens, max_tokens, timeout, before, samples, reader, leak) -> dict:
    rss = [s["rss_bytes"] for s in samples if s["rss_bytes"] is not None]
    start, peak, end = before["rss_bytes"], max(rss), rss[-1]
    growth_mb = (peak - start) / 1e6
    metric_present = before["stalled_aborts"] is not None
    abort_seen_at = (
        first_time(samples, lambda s: (s["stalled_aborts"] or 0) > before["stalled_aborts"]) if metric_present else None
    )
    finished_at = first_time(samples, lambda s: (s["finished"] or 0) > (before["finished"] or 0))
    engine_aborted_at = first_time(samples, lambda s: (s["engine_aborted"] or 0) > (before["engine_aborted"] or 0))
    queued = [(s["server_send_queue_bytes"], s["t_s"]) for s in samples if s["server_send_queue_bytes"] is not None]
    top = max((q for q, _ in queued), default=None)
    plateau_at = next((t for q, t in queued if q == top), None)
    aborted = abort_seen_at is not None
    # After the abort (the later of the close and the counter's rise) the request must hold nothing.
    since = max(t for t in (reader.closed_at, abort_seen_at) if t is not None) if aborted else None
    after = [s for s in samples if since is not None and s["t_s"] >= since]
    last = samples[-1]
    received = bytes(reader.received)
    out = {
        "model": model,
        "max_model_len": max_model_len,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "rcvbuf_requested": args.rcvbuf,
        "rcvbuf_effective": reader.rcvbuf_effective,
        "read_interval_s": args.read_interval,
        "duration_s": args.duration,
        "stalled_client_timeout_s": timeout,
        "rss_start_mb": start / 1e6,
        "rss_max_mb": peak / 1e6,
        "rss_end_mb": end / 1e6,
        "rss_growth_mb": growth_mb,
        "max_growth_mb": args.max_growth_mb,
        "rss_pass": growth_mb <= args.max_growth_mb,
        "closed_by_server_after_s": reader.closed_at,
        "closed_how": reader.closed_how,
        "server_send_queue_max_bytes": top,
        "server_send_queue_max_first_seen_s": plateau_at,
        "client_error": reader.error,
        "client_bytes_read": len(received),
        "client_first_line": received.split(b"\r\n", 1)[0].decode("latin-1") if b"\r\n" in received else None,
        "stalled_metric_present": metric_present,
        "stalled_aborts_before": before["stalled_aborts"],
        "stalled_aborts_end": last["stalled_aborts"],
        "stalled_abort_seen_at_s": abort_seen_at,
        "engine_finished_seen_at_s": finished_at,
        "engine_aborted_seen_at_s": engine_aborted_at,
        "aborted": aborted,
        "kv_blocks_held_before": held(before),
        "num_running_end": last["num_running"],
        "kv_blocks_held_end": held(last),
        "freed_after_abort": (
            bool(after) and after[-1]["num_running"] == 0 and held(after[-1]) == held(before) if aborted else None
        ),
        "kv_blocks_used_after_reset": leak,
        "samples": samples,
    }
    out["abort_pass"] = timeout is None or (aborted and reader.closed_at is not None)
    out["pass"] = out["rss_pass"] and out["abort_pass"]
    return out


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] for s in out["samples"] if s["rss_bytes"] is not None]
    mb = [s["rss_bytes"] / 1e6 for s in out["samples"] if s["rss_bytes"] is not None]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(t, mb, marker=".", label="server RSS")
    ax.axhline(out["rss_start_mb"] + out["max_growth_mb"], color="gray", ls="--", label="start + allowed growth")
    if out["closed_by_server_after_s"] is not None:
        ax.axvline(out["closed_by_server_after_s"], color="red", ls=":", label="server closed the slow connection")
    if out["stalled_abort_seen_at_s"] is not None:
        ax.axvline(out["stalled_abort_seen_at_s"], color="purple", ls="-.", label=f"{STALLED_METRIC} rose (sampled)")
    ax.set_xlabel("seconds since the slow request started")
    ax.set_ylabel("RSS (MB)")
    timeout = out["stalled_client_timeout_s"]
    ax.set_title(
        f"slow reader: 1 byte / {out['read_interval_s']:g} s, max_tokens {out['max_tokens']}, "
        f"--stalled-client-timeout {'none' if timeout is None else f'{timeout:g} s'}"
    )
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="use this running server (loopback only; needs --pid)")
    p.add_argument("--pid", type=int, default=None, help="process id of the --url server (for its RSS)")
    p.add_argument("--model", default="lite-tiny", help="--model for the started server (default: lite-tiny)")
    p.add_argument("--threads", type=int, default=1, help="--threads for the started server (default: 1)")
    p.add_argument(
        "--server-arg", action="append", default=[], help="extra flag for the started server (repeatable; use --x=y)"
    )
    p.add_argument("--prompt", default=PROMPT, help="the slow request's prompt")
    p.add_argument("--max-tokens", type=int, default=None, help="cap max_tokens (default: the context minus prompt)")
    p.add_argument("--rcvbuf", type=int, default=4096, help="SO_RCVBUF of the slow client in bytes (default: 4096)")
    p.add_argument("--read-interval", type=float, default=2.0, help="seconds between 1-byte reads (default: 2)")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples (default: 5)")
    p.add_argument("--duration", type=float, default=300.0, help="seconds to watch (default: 300)")
    p.add_argument(
        "--max-growth-mb", type=float, default=50.0, help="pass if RSS grows at most this many MB of 10^6 bytes (50)"
    )
    p.add_argument("--plot", default=None, metavar="PATH", help="save a plot of RSS over time")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if not (args.read_interval > 0 and args.sample_every > 0 and args.duration > 0):
        p.error("--read-interval, --sample-every and --duration must be > 0")
    if args.max_tokens is not None and args.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    if args.url is not None:
        if args.pid is None:
            p.error("--url needs --pid (the server's process, for its RSS)")
        check_loopback(args.url)
        out = run(args.url.rstrip("/"), args.pid, args)
    else:
        with ServerProcess(args.model, args.threads, args.server_arg) as server:
            out = run(server.url, server.pid, args)
            out["server_cmd"] = server.cmd
    if args.plot:
        plot(out, args.plot)
    if args.json:
        print(json.dumps(out))
    else:
        print_summary(out)
        if args.plot:
            print(f"plot: {args.plot}")
    return 0 if out["pass"] else 1


def print_summary(out: dict) -> None:
    verdict = "PASS" if out["rss_pass"] else "FAIL"
    print(
        f"RSS: start {out['rss_start_mb']:.1f} MB (warm), max {out['rss_max_mb']:.1f} MB, end {out['rss_end_mb']:.1f} "
        f"MB; growth {out['rss_growth_mb']:+.1f} MB -> {verdict} (limit {out['max_growth_mb']:g} MB)"
    )
    timeout = out["stalled_client_timeout_s"]
    configured = "not configured" if timeout is None else f"configured {timeout:g} s"
    closed = out["closed_by_server_after_s"]
    if closed is not None:
        print(f"the server closed the slow connection {closed:.1f} s after the request started ({out['closed_how']})")
    else:
        print(f"the slow connection was still open after {out['duration_s']:g} s")
    if out["server_send_queue_max_bytes"] is not None:
        print(
            f"the server's kernel send queue peaked at {out['server_send_queue_max_bytes']:,} bytes, first seen at "
            f"t={out['server_send_queue_max_first_seen_s']:.1f} s (data the server wrote that the client never read)"
        )
    if out["stalled_metric_present"]:
        rise = out["stalled_abort_seen_at_s"]
        rose = f"rose, seen at t={rise:.1f} s" if rise is not None else "did not rise"
        print(f"{STALLED_METRIC}: {out['stalled_aborts_before']:g} -> {out['stalled_aborts_end']:g} ({rose})")
    else:
        print(f"{STALLED_METRIC}: not exported by this server")
    for key, what in (("engine_finished_seen_at_s", "finished"), ("engine_aborted_seen_at_s", "aborted")):
        if out[key] is not None:
            print(f"the engine {what} the slow request (seen at t={out[key]:.1f} s)")
    if out["aborted"]:
        print(f"slow client aborted (--stalled-client-timeout {configured})")
    else:
        print(f"no abort seen in {out['duration_s']:g} s (--stalled-client-timeout {configured})")
    if out["client_error"]:
        print(f"slow client error: {out['client_error']}")
    print(f"slow client read {out['client_bytes_read']} bytes; first line: {out['client_first_line']!r}")
    freed = out["freed_after_abort"]
    print(
        f"engine at the end: num_running {out['num_running_end']}, KV blocks held by requests "
        f"{out['kv_blocks_held_end']} (before the slow request {out['kv_blocks_held_before']})"
        + ("" if freed is None else f"; freed after the abort: {'yes' if freed else 'no'}")
    )
    if out["kv_blocks_used_after_reset"] is not None:
        used = out["kv_blocks_used_after_reset"]
        idle = "" if out["idle_before_reset"] else " (the engine was still running a request)"
        print(f"after the client left and the prefix cache was dropped: {used} KV blocks used{idle}")
    print("PASS" if out["pass"] else "FAIL")


if __name__ == "__main__":
    sys.exit(main())
