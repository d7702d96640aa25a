"""What the router costs: added TTFT, router CPU per request, and throughput at concurrency 1, 50, 500.

Measured the way the overhead budget's anchor (vLLM's example multi-turn proxy, FastAPI + httpx) was measured on
this 2-core machine:

* the router (``python -m impl.router``) pinned to core 0 with ``taskset``;
* a local upstream on core 1 playing P (JSON body with ``kv_transfer_params`` for ``max_tokens=1``
  requests) and D (16 streamed chunks, no delay, ``kv_transfer_params`` on the final chunk, then
  ``[DONE]``), written on raw asyncio so that it costs little;
* this process as the load generator, also on core 1: closed-loop 5-turn chat conversations carrying
  ``conversation_id`` (turns 2-5 are store hits that pass the guard), one keep-alive connection per
  virtual user, a raw HTTP/1.1 client (again: cheap, so the router is what is measured);
* each concurrency level run twice against the router and twice against the upstream directly
  (one D call, no P): added TTFT = router percentile - direct percentile;
* router CPU ms/request from /proc/<pid>/stat (utime + stime) over the measured window, and the
  router's involuntary context switches per 1,000 requests (how often something else took its core:
  the cause of latency tails when the machine is busy) next to the 1-minute load average;
* upstream connections for turns opened and closed during the window, counted apart from those the
  router's health probes open: reused, not reopened, means none closed (a few opened at c=500 are
  the pool growing to a new peak of concurrent requests, as the router's clients ramp up).

Run: ``.venv/bin/python benchmarks/router_overhead.py [--duration 5] [--levels 1,50,500] [--loop uvloop]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHUNKS = 16
TURNS = 5
ANSWER = "".join(f"tok{i} " for i in range(CHUNKS))

# -- the upstream (P and D in one raw asyncio server) -------------------------------------------------


def _d_response(check: dict | None = None) -> bytes:
    events = []
    for i in range(CHUNKS):
        chunk = {"id": "cmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": "bench",
                 "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": "stop" if i == CHUNKS - 1 else None}]}
        if i == CHUNKS - 1:
            chunk["kv_transfer_params"] = {
                "do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [[1, 2, 3, 4]],
                "remote_engine_id": "D-bench", "remote_request_id": "d-bench", "remote_host": "127.0.0.1",
                "remote_port": 5700, "tp_size": 1, "remote_num_tokens": 512, "remote_blocks_expiry_time": 1e12}
            if check is not None:
                chunk["kv_transfer_params"]["bidikv_prefix_check"] = check
        events.append(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    body = b"".join(events)
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")


def next_request(buf: bytes) -> tuple[tuple[bytes, bytes] | None, bytes]:
    """The first complete HTTP/1.1 request in ``buf`` as (path, body), and what follows it; (None, buf)
    while it is incomplete. Enough for the benchmarks' own clients (Content-Length bodies only)."""
    head_end = buf.find(b"\r\n\r\n")
    if head_end < 0:
        return None, buf
    head = buf[:head_end]
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    end = head_end + 4 + length
    if len(buf) < end:
        return None, buf
    return (head.split(b" ", 2)[1], buf[head_end + 4:end]), buf[end:]


def _json_response(obj: dict) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body


P_RESPONSE = _json_response({"id": "cmpl-p", "object": "chat.completion", "model": "bench",
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}],
                             "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                                    "remote_block_ids": [[1, 2]], "remote_engine_id": "P-bench",
                                                    "remote_request_id": "p-bench", "remote_host": "127.0.0.1",
                                                    "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 500}})
D_RESPONSE = _d_response()


def use_verifying_upstream() -> None:
    """D publishes a token-exact check (impl.policy.prefix_check, 512 tokens) and P answers offers with its
    report: the router then stores turns without its message guard and reads P's report."""
    global D_RESPONSE, P_RESPONSE
    from impl.policy.prefix_check import chain_block_hashes, publish, scheme_tag

    ids = list(range(512))
    check = publish(chain_block_hashes(ids, 16), ids, 512, scheme=scheme_tag("sha256", 16, "bench", b""),
                    block_size=16, anchor_tokens=[400])
    D_RESPONSE = _d_response(check)
    p = json.loads(P_RESPONSE.split(b"\r\n\r\n", 1)[1])
    p["kv_transfer_params"]["bidikv_reuse"] = {"path": "d_to_p", "offered": 512, "verified": 480, "pulled": 480,
                                               "reason": "partial"}
    P_RESPONSE = _json_response(p)
STATS = {"connections": 0, "requests": 0, "turn_connections": 0, "turn_connections_closed": 0, "health_connections": 0}


class UpstreamProtocol(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
        self.buf = b""
        self.kind = None
        STATS["connections"] += 1

    def connection_lost(self, exc):
        if self.kind == "turn":
            STATS["turn_connections_closed"] += 1

    def data_received(self, data):
        self.buf += data
        while True:
            request, self.buf = next_request(self.buf)
            if request is None:
                return
            path, body = request
            STATS["requests"] += 1
            if self.kind is None:  # what this connection was opened for
                self.kind = "turn" if path.startswith(b"/v1/") else "health" if path.startswith(b"/health") else "other"
                if self.kind == "turn":
                    STATS["turn_connections"] += 1
                elif self.kind == "health":
                    STATS["health_connections"] += 1
            if path == b"/stats":
                self.transport.write(_json_response(STATS))
            elif path.startswith(b"/health"):
                self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            elif b'"stream":true' in body or b'"stream": true' in body:
                self.transport.write(D_RESPONSE)
            else:
                self.transport.write(P_RESPONSE)


def run_upstream(port: int) -> None:
    _use_uvloop()

    async def main():
        server = await asyncio.get_running_loop().create_server(UpstreamProtocol, "127.0.0.1", port, backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# -- the load generator ---------------------------------------------------------------------------------


@dataclass
class Samples:
    ttft: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    started: list[float] = field(default_factory=list)  # seconds into the window
    errors: int = 0


class RawClient:
    """One keep-alive HTTP/1.1 connection; POSTs and reads a chunked or sized response."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[float, float, int]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        t0 = time.perf_counter()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        lower = head.lower()
        ttft = None
        if b"transfer-encoding: chunked" in lower:
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                data = await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                if ttft is None and b"data:" in data:
                    ttft = time.perf_counter() - t0
        else:
            length = 0
            for line in lower.split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await self.reader.readexactly(length)
        total = time.perf_counter() - t0
        if b"connection: close" in lower:
            self.writer.close()
            self.writer = None
        return (ttft if ttft is not None else total), total, status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def user_loop(uid: int, port: int, via_router: bool, stop_at: float, record_from: float, samples: Samples,
                    send_id: bool = True) -> int:
    client = RawClient("127.0.0.1", port)
    conversation = 0
    done = 0
    try:
        while time.perf_counter() < stop_at:
            conversation += 1
            cid = f"u{uid}-c{conversation}-{os.getpid()}"
            messages = [{"role": "user", "content": f"[{cid}] hello, this is turn 0 of a benchmark conversation"}]
            for turn in range(TURNS):
                if time.perf_counter() >= stop_at:
                    break
                body = {"model": "bench", "messages": messages, "stream": True, "max_tokens": CHUNKS}
                if via_router and send_id:
                    body["conversation_id"] = cid
                try:
                    ttft, total, status = await client.post("/v1/chat/completions", json.dumps(body).encode())
                except (OSError, asyncio.IncompleteReadError, ValueError):
                    samples.errors += 1
                    client.close()
                    client = RawClient("127.0.0.1", port)
                    continue
                started = time.perf_counter() - total
                if status != 200:
                    samples.errors += 1
                elif started >= record_from:  # only requests started in the window (not the warmup's)
                    samples.ttft.append(ttft)
                    samples.total.append(total)
                    samples.started.append(started - record_from)
                    done += 1
                messages = messages + [{"role": "assistant", "content": ANSWER},
                                       {"role": "user", "content": f"turn {turn + 1}, please continue"}]
    finally:
        client.close()
    return done


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def involuntary_switches(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("nonvoluntary_ctxt_switches:"):
            return int(line.split()[1])
    return 0


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


async def fetch_stats(port: int) -> dict:
    client = RawClient("127.0.0.1", port)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /stats HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    length = int([l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")][0].split(b":")[1])
    data = json.loads(await reader.readexactly(length))
    writer.close()
    client.close()
    return data


async def run_level(port: int, via_router: bool, concurrency: int, warmup: float, duration: float, router_pid: int | None,
                    upstream_port: int, send_id: bool = True) -> dict:
    samples = Samples()
    start = time.perf_counter()
    record_from = start + warmup
    stop_at = record_from + duration

    async def measure():
        await asyncio.sleep(max(0.0, record_from - time.perf_counter()))
        return ((cpu_seconds(router_pid), involuntary_switches(router_pid)) if router_pid else (0.0, 0)), \
            (await fetch_stats(upstream_port))

    measurer = asyncio.ensure_future(measure())
    counts = await asyncio.gather(*(user_loop(i, port, via_router, stop_at, record_from, samples, send_id) for i in range(concurrency)))
    (cpu0, switches0), stats0 = await measurer
    window = time.perf_counter() - record_from  # users finish their in-flight request after stop_at
    cpu1 = cpu_seconds(router_pid) if router_pid else 0.0
    switches1 = involuntary_switches(router_pid) if router_pid else 0
    stats1 = await fetch_stats(upstream_port)
    n = sum(counts)
    return {
        "concurrency": concurrency, "requests": n, "errors": samples.errors, "req_per_s": n / window,
        "ttft_p50_ms": pct(samples.ttft, 0.5) * 1e3, "ttft_p99_ms": pct(samples.ttft, 0.99) * 1e3,
        "total_p50_ms": pct(samples.total, 0.5) * 1e3, "total_p99_ms": pct(samples.total, 0.99) * 1e3,
        "router_cpu_ms_per_req": ((cpu1 - cpu0) / n * 1e3) if (router_pid and n) else None,
        "router_preemptions_per_1k_req": ((switches1 - switches0) / n * 1e3) if (router_pid and n) else None,
        "upstream_connections_opened": stats1["turn_connections"] - stats0["turn_connections"],
        "upstream_connections_closed": stats1["turn_connections_closed"] - stats0["turn_connections_closed"],
        "health_probe_connections_opened": stats1["health_connections"] - stats0["health_connections"],
        "load_avg_1m": load_average(),
    }


# -- orchestration ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _use_uvloop() -> bool:
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def pinned(cmd: list[str], core: int, pin: bool) -> list[str]:
    if pin and shutil.which("taskset"):
        return ["taskset", "-c", str(core), *cmd]
    return cmd


def wait_http(port: int, path: str = "/health", timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"nothing healthy on port {port} after {timeout} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--levels", default="1,50,500")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--duration", type=float, default=5.0, help="measured seconds per run")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds before the window; requests started in it are not counted")
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop", help="the router's event loop")
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--match", choices=["id", "history"], default="id",
                    help="id: clients send conversation_id; history: they send none, as the openai SDK does, and the "
                         "router finds each turn by the history it resends")
    ap.add_argument("--verified", action="store_true",
                    help="D publishes a token-exact prefix check and P reports its verification (our connector)")
    ap.add_argument("--upstream", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.upstream:
        if args.verified:
            use_verifying_upstream()
        run_upstream(args.port)
        return 0

    pin = not args.no_pin
    if pin and hasattr(os, "sched_setaffinity") and os.cpu_count() and os.cpu_count() >= 2:
        os.sched_setaffinity(0, {1})  # the load generator shares core 1 with the upstream
    _use_uvloop()
    up_port, router_port = free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = []
    try:
        procs.append(subprocess.Popen(pinned([sys.executable, __file__, "--upstream", "--port", str(up_port)] + (["--verified"] if args.verified else []), 1, pin), env=env))
        wait_http(up_port)
        router_cmd = [sys.executable, "-m", "impl.router", "--prefill", f"http://127.0.0.1:{up_port}",
                      "--decode", f"http://127.0.0.1:{up_port}", "--host", "127.0.0.1", "--port", str(router_port),
                      "--loop", args.loop, "--log-level", "warning", "--health-interval-s", "5",
                      "--max-model-len", "131072"]  # no /v1/models probe: this upstream answers only turns
        router = subprocess.Popen(pinned(router_cmd, 0, pin), env=env, cwd=ROOT)
        procs.append(router)
        wait_http(router_port)
        results = []
        for c in [int(x) for x in args.levels.split(",")]:
            for rep in range(args.reps):
                for target in ("direct", "router"):
                    port = router_port if target == "router" else up_port
                    res = asyncio.run(run_level(port, target == "router", c, args.warmup, args.duration,
                                                router.pid if target == "router" else None, up_port,
                                                args.match == "id"))
                    res.update(target=target, rep=rep)
                    results.append(res)
                    print(json.dumps(res), flush=True)
        summarize(results)
        print_reuse(router_port)
        if args.json:
            Path(args.json).write_text(json.dumps({"loop": args.loop, "pinned": pin, "results": results}, indent=1))
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0


def print_reuse(router_port: int) -> None:
    """What the router matched over the whole run: turns 2-5 must hit, by the id or by the history."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{router_port}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    wanted = ("bidikv_router_reuse_hits_total", "bidikv_router_reuse_matches_total", "bidikv_router_reuse_misses_total")
    print("router reuse:", "; ".join(line for line in lines if line.startswith(wanted)))


def summarize(results: list[dict]) -> None:
    print("\nconcurrency rep | router req/s | added TTFT p50/p99 ms | added total p50/p99 ms | router CPU ms/req | upstream conns opened/closed | errors"
          " | preempted /1k req | load")
    by = {(r["target"], r["concurrency"], r["rep"]): r for r in results}
    for (target, c, rep), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if target != "router":
            continue
        d = by[("direct", c, rep)]
        cpu = r["router_cpu_ms_per_req"]
        print(f"{c:>11} {rep:>3} | {r['req_per_s']:>12.0f} | {r['ttft_p50_ms'] - d['ttft_p50_ms']:>8.2f} / {r['ttft_p99_ms'] - d['ttft_p99_ms']:<8.2f}"
              f" | {r['total_p50_ms'] - d['total_p50_ms']:>8.2f} / {r['total_p99_ms'] - d['total_p99_ms']:<8.2f}"
              f" | {cpu if cpu is None else format(cpu, '.3f'):>17} | {r['upstream_connections_opened']:>20}/{r['upstream_connections_closed']:<6} | {r['errors']:>6}"
              f" | {r['router_preemptions_per_1k_req']:>17.1f} | {r['load_avg_1m']:.2f}"
              f"   (direct: {d['req_per_s']:.0f} req/s, TTFT p50 {d['ttft_p50_ms']:.2f} p99 {d['ttft_p99_ms']:.2f} ms)")
    levels = sorted({r["concurrency"] for r in results})
    if 50 in levels and 500 in levels:
        rps = {c: statistics.mean(r["req_per_s"] for r in results if r["target"] == "router" and r["concurrency"] == c) for c in (50, 500)}
        print(f"\nc=500 throughput / c=50 throughput = {rps[500] / rps[50]:.2f} (no collapse: >= 0.8)")


if __name__ == "__main__":
    sys.exit(main())
