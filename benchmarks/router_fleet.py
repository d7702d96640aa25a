"""Router replicas sharing conversations through Redis: reuse hit rate, added TTFT, Redis restart.

Same bench bed as benchmarks/router_overhead.py (its raw-asyncio upstream plays P and D; this process is
the closed-loop load generator sending 5-turn chat conversations with ``conversation_id``), plus a real
``redis-server`` (the OS package) on a free loopback port, no persistence unless ``--appendonly``.

1. **hit rate** -- turn k of every conversation goes to router k mod n (round robin across replicas, the
   worst case for a per-process store): one router with the in-memory store, two with in-memory stores
   (the per-process stores lose half the reuse), two sharing Redis. Hit rate = the routers' summed
   ``reuse_hits_total`` / turns that could hit (turns 2-5). Upstream answers are instant, so the
   concurrency makes turns race their own previous turn's store only as a real client would (never:
   a client sends turn k+1 after turn k's [DONE]).
2. **added TTFT** -- two routers pinned to core 0 (one in-memory, one on Redis), c=1, the load generator
   sending one turn to each in turn, ``--reps`` windows: both see the same background load (on this
   shared machine it moves more than the store does). The difference of the p50s (and p99s) over
   turns 2-5 is what the store costs a turn: one Redis round trip for the lookup (its write happens at
   the end of D's stream: "added to the end").
3. **Redis restart** -- two routers on Redis, c=4 round robin; Redis SIGKILLed at ``--kill-at`` s and
   started again (same port) ``--down-s`` later. Per half second: turns answered, turns failed (non-200
   or an SSE error), turns offered reuse; and how long after Redis answers PING again the first turn is
   offered reuse. With ``--appendonly`` Redis keeps its entries across the restart (fsync every second).

Run: ``.venv/bin/python benchmarks/router_fleet.py [--part all|hits|ttft|restart] [--duration 6] [--reps 2]``
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.router_overhead import (ANSWER, CHUNKS, D_RESPONSE, TURNS, UpstreamProtocol,  # noqa: E402
                                        _use_uvloop, free_port, load_average, pct, pinned, wait_http)
from tests.redis_server import RedisServer  # noqa: E402  (the same real server the tests start)


# D's answer in two writes, FIRST_GAP_S apart: its first event, then the rest with [DONE]. The router
# stores a turn when D's stream ends, so with one write (router_overhead.py's upstream) the client's
# first byte would wait for the store's write too; split, TTFT is lookup + P + D's first event, as with
# a real D whose later tokens take time, and "total" includes the store's write.
FIRST_GAP_S = 0.002
_HEAD, _, _BODY = D_RESPONSE.partition(b"\r\n\r\n")
_EVENTS = _BODY.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n\r\n", 1)[0].split(b"\n\n")
_FIRST = _EVENTS[0] + b"\n\n"
_REST = b"\n\n".join(_EVENTS[1:])


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


class _SplitWrites:
    def __init__(self, transport) -> None:
        self.transport = transport

    def write(self, data: bytes) -> None:
        if data is not D_RESPONSE:
            self.transport.write(data)
            return
        self.transport.write(_HEAD + b"\r\n\r\n" + _chunk(_FIRST))
        asyncio.get_running_loop().call_later(FIRST_GAP_S, self.transport.write, _chunk(_REST) + b"0\r\n\r\n")

    def __getattr__(self, name):
        return getattr(self.transport, name)


class SplitUpstream(UpstreamProtocol):
    def connection_made(self, transport):
        super().connection_made(_SplitWrites(transport))


def run_upstream(port: int) -> None:
    _use_uvloop()

    async def main():
        server = await asyncio.get_running_loop().create_server(SplitUpstream, "127.0.0.1", port, backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


class Client:
    """One keep-alive HTTP/1.1 connection: POST, read a chunked or sized answer, keep the head."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader = self.writer = None

    async def post(self, path: str, body: bytes) -> tuple[float, float, int, bytes, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        t0 = time.perf_counter()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        lower = head.lower()
        ttft, data = None, []
        if b"transfer-encoding: chunked" in lower:
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                chunk = await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                data.append(chunk)
                if ttft is None and b"data:" in chunk:
                    ttft = time.perf_counter() - t0
        else:
            length = next((int(line.split(b":")[1]) for line in lower.split(b"\r\n") if line.startswith(b"content-length:")), 0)
            data.append(await self.reader.readexactly(length))
        total = time.perf_counter() - t0
        return (ttft if ttft is not None else total), total, status, lower, b"".join(data)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def offered(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        if line.startswith(b"x-bidikv-reuse-offered-tokens:"):
            return int(line.split(b":")[1])
    return 0


async def conversations(ports: list[int], concurrency: int, duration: float, log: list | None = None,
                        t_origin: float | None = None) -> dict:
    """Closed loop: each user runs 5-turn conversations, turn k on router k mod len(ports)."""
    stop_at = time.perf_counter() + duration
    ttft: list[float] = []
    totals: list[float] = []
    counts = {"turns": 0, "could_hit": 0, "offered": 0, "failed": 0}
    why: dict[str, int] = {}  # failed turns by status code, SSE error or exception
    origin = t_origin if t_origin is not None else time.perf_counter()

    async def user(uid: int) -> None:
        clients = [Client(p) for p in ports]
        try:
            for conv in itertools.count():
                if time.perf_counter() >= stop_at:
                    return
                cid = f"u{uid}-c{conv}-{os.getpid()}-{time.time_ns()}"
                messages = [{"role": "user", "content": f"[{cid}] hello, this is turn 0 of a benchmark conversation"}]
                for turn in range(TURNS):
                    client = clients[turn % len(clients)]
                    body = json.dumps({"model": "bench", "messages": messages, "stream": True, "max_tokens": CHUNKS,
                                       "conversation_id": cid}).encode()
                    started = time.perf_counter()
                    try:
                        t, total, status, head, data = await client.post("/v1/chat/completions", body)
                        ok = status == 200 and b'"error"' not in data and b"[DONE]" in data
                        reason = "" if ok else f"http_{status}" if status != 200 else "sse_error_or_no_done"
                    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
                        client.close()
                        ok, t, total, head, reason = False, 0.0, 0.0, b"", type(e).__name__
                    if not ok:
                        why[reason] = why.get(reason, 0) + 1
                    counts["turns"] += 1
                    counts["failed"] += not ok
                    counts["could_hit"] += turn > 0
                    hit = ok and offered(head) > 0
                    counts["offered"] += hit
                    if ok:
                        ttft.append(t)
                        totals.append(total)
                    if log is not None:
                        log.append((started - origin, ok, hit))
                    messages = messages + [{"role": "assistant", "content": ANSWER},
                                           {"role": "user", "content": f"turn {turn + 1}, please continue"}]
        finally:
            for c in clients:
                c.close()

    await asyncio.gather(*(user(u) for u in range(concurrency)))
    counts["ttft_p50_ms"] = pct(ttft, 0.5) * 1e3
    counts["ttft_p99_ms"] = pct(ttft, 0.99) * 1e3
    counts["total_p50_ms"] = pct(totals, 0.5) * 1e3
    counts["why"] = why
    return counts


def scrape(port: int, name: str) -> float:
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


class Bed:
    """The upstream, Redis and routers, as subprocesses; everything stopped on exit."""

    def __init__(self, pin: bool, appendonly: bool = False, redis_core: str = "any", redis_nice: int = 0) -> None:
        self.pin = pin
        self.redis_core = redis_core
        self.redis_nice = redis_nice
        self.env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.procs: list[subprocess.Popen] = []
        self.up_port = free_port()
        self.redis = RedisServer(appendonly=appendonly)
        self.prefix_n = 0

    def __enter__(self) -> "Bed":
        self.procs.append(subprocess.Popen(pinned([sys.executable, __file__, "--upstream", "--port", str(self.up_port)],
                                                  1, self.pin), env=self.env))
        wait_http(self.up_port)
        self.redis.start()
        if self.redis_nice:
            os.setpriority(os.PRIO_PROCESS, self.redis.proc.pid, self.redis_nice)
        if self.pin and self.redis_core != "any" and self.redis.proc is not None:
            subprocess.run(["taskset", "-pc", self.redis_core, str(self.redis.proc.pid)], capture_output=True)
        return self

    def router(self, store: str, core: int = 0) -> tuple[subprocess.Popen, int]:
        port = free_port()
        self.prefix_n += 1
        cmd = [sys.executable, "-m", "impl.router", "--prefill", f"http://127.0.0.1:{self.up_port}",
               "--decode", f"http://127.0.0.1:{self.up_port}", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning", "--health-interval-s", "5", "--store", store,
               "--store-prefix", f"bench{os.getpid()}-{self.prefix_n // 100}:"]
        proc = subprocess.Popen(pinned(cmd, core, self.pin), env=self.env, cwd=ROOT)
        self.procs.append(proc)
        wait_http(port)
        return proc, port

    def stop(self, proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        self.procs.remove(proc)

    def __exit__(self, *exc) -> None:
        for p in reversed(self.procs):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.redis.close()


def part_hits(bed: Bed, duration: float, concurrency: int) -> None:
    print(f"\n== reuse hit rate, turns round robin over the routers, c={concurrency}, {duration:.0f} s each ==")
    print("setup                     | turns | could hit | hits (router metric) | hit rate | failed | load")
    for label, stores in (("1 router, memory", ["memory"]), ("2 routers, memory each", ["memory", "memory"]),
                          ("2 routers, shared Redis", [bed.redis.url, bed.redis.url])):
        bed.prefix_n = (bed.prefix_n // 100 + 1) * 100  # one key prefix per setup
        routers = [bed.router(s, core=0) for s in stores]
        ports = [p for _, p in routers]
        res = asyncio.run(conversations(ports, concurrency, duration))
        hits = sum(scrape(p, "bidikv_router_reuse_hits_total") for p in ports)
        print(f"{label:<25} | {res['turns']:>5} | {res['could_hit']:>9} | {hits:>20.0f} | {hits / max(1, res['could_hit']):>8.3f}"
              f" | {res['failed']:>6} | {load_average():.2f}" + (f"  failures: {res['why']}" if res["why"] else ""), flush=True)
        for proc, _ in routers:
            bed.stop(proc)


async def paired(ports: list[int], duration: float) -> list[list[tuple[float, float]]]:
    """c=1, one turn to each router in turn (each with its own 5-turn conversations): both see the
    same background load, which on this shared machine moves more than the store does."""
    stop_at = time.perf_counter() + duration
    clients = [Client(p) for p in ports]
    samples: list[list[tuple[float, float]]] = [[] for _ in ports]
    state = [None] * len(ports)  # (cid, messages, turn) per router
    n = 0
    try:
        while time.perf_counter() < stop_at:
            for i, client in enumerate(clients):
                if state[i] is None or state[i][2] == TURNS:
                    n += 1
                    cid = f"paired{i}-{n}-{os.getpid()}-{time.time_ns()}"
                    state[i] = (cid, [{"role": "user", "content": f"[{cid}] hello, this is turn 0 of a benchmark conversation"}], 0)
                cid, messages, turn = state[i]
                body = json.dumps({"model": "bench", "messages": messages, "stream": True, "max_tokens": CHUNKS,
                                   "conversation_id": cid}).encode()
                t, total, status, _, data = await client.post("/v1/chat/completions", body)
                if status == 200 and b"[DONE]" in data and turn > 0:  # turns 2-5: the lookup hits
                    samples[i].append((t, total))
                state[i] = (cid, messages + [{"role": "assistant", "content": ANSWER},
                                             {"role": "user", "content": f"turn {turn + 1}, please continue"}], turn + 1)
    finally:
        for c in clients:
            c.close()
    return samples


def part_ttft(bed: Bed, duration: float, reps: int) -> None:
    where = "on core 0" if bed.pin else "unpinned"
    print(f"\n== added TTFT of the shared store: two routers (in-memory, Redis) {where}, c=1, turns alternating "
          f"between them, {duration:.0f} s windows; turns 2-5 (store hits) ==")
    print("rep | turns each | memory TTFT p50 / p99 ms | Redis TTFT p50 / p99 ms | added p50 / p99 ms | added to the end p50 ms | load")
    for rep in range(reps):
        bed.prefix_n = (bed.prefix_n // 100 + 1) * 100
        routers = [bed.router("memory", core=0), bed.router(bed.redis.url, core=0)]
        ports = [p for _, p in routers]
        asyncio.run(paired(ports, 2.0))  # warm-up: connections, scripts loaded
        mem, red = asyncio.run(paired(ports, duration))
        mt, rt = [t for t, _ in mem], [t for t, _ in red]
        me, re_ = [e for _, e in mem], [e for _, e in red]
        print(f"{rep:>3} | {min(len(mem), len(red)):>10} | {pct(mt, .5) * 1e3:>10.3f} / {pct(mt, .99) * 1e3:<11.3f} |"
              f" {pct(rt, .5) * 1e3:>9.3f} / {pct(rt, .99) * 1e3:<11.3f} | {(pct(rt, .5) - pct(mt, .5)) * 1e3:>+7.3f} /"
              f" {(pct(rt, .99) - pct(mt, .99)) * 1e3:<+8.3f} | {(pct(re_, .5) - pct(me, .5)) * 1e3:>+23.3f} | {load_average():.2f}",
              flush=True)
        for proc, _ in routers:
            bed.stop(proc)


def part_restart(bed: Bed, kill_at: float, down_s: float, total_s: float) -> None:
    print(f"\n== Redis SIGKILLed at {kill_at:.1f} s, restarted {down_s:.1f} s later (appendonly: "
          f"{'yes' if bed.redis.appendonly else 'no'}); 2 routers, c=4 round robin ==")
    bed.prefix_n = (bed.prefix_n // 100 + 1) * 100
    routers = [bed.router(bed.redis.url, core=0) for _ in range(2)]
    ports = [p for _, p in routers]
    log: list = []
    marks: dict[str, float] = {}

    async def run() -> dict:
        origin = time.perf_counter()

        async def chaos() -> None:
            await asyncio.sleep(kill_at)
            bed.redis.stop()
            marks["killed"] = time.perf_counter() - origin
            await asyncio.sleep(down_s)
            await asyncio.get_running_loop().run_in_executor(None, bed.redis.start)  # returns once PING answers
            marks["back"] = time.perf_counter() - origin

        task = asyncio.create_task(chaos())
        res = await conversations(ports, 4, total_s, log, origin)
        await task
        return res

    res = asyncio.run(run())
    print("window s   | turns | failed | offered reuse")
    for b in range(int(total_s / 0.5)):
        rows = [x for x in log if b * 0.5 <= x[0] < (b + 1) * 0.5]
        note = ""
        if "killed" in marks and b * 0.5 <= marks["killed"] < (b + 1) * 0.5:
            note = "  <- Redis killed"
        if "back" in marks and b * 0.5 <= marks["back"] < (b + 1) * 0.5:
            note += "  <- Redis answers again"
        print(f"{b * 0.5:>4.1f}-{(b + 1) * 0.5:<4.1f} | {len(rows):>5} | {sum(not ok for _, ok, _ in rows):>6} | "
              f"{sum(h for _, _, h in rows):>5}{note}")
    first_hit = min((t for t, ok, h in log if h and t >= marks.get("back", 1e9)), default=None)
    unavailable = sum(scrape(p, 'bidikv_router_reuse_misses_total{reason="store_unavailable"}') for p in ports)
    print(f"turns {res['turns']}, failed {res['failed']}; lookups answered store_unavailable: {unavailable:.0f}; "
          f"first turn offered reuse {first_hit - marks['back']:.3f} s after Redis answered again"
          if first_hit is not None else "no reuse after the restart", f"; load {load_average():.2f}")
    for proc, _ in routers:
        bed.stop(proc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["all", "hits", "ttft", "restart"], default="all")
    ap.add_argument("--duration", type=float, default=6.0, help="measured seconds per hit-rate / TTFT run")
    ap.add_argument("--concurrency", type=int, default=8, help="users in the hit-rate runs")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--kill-at", type=float, default=3.0)
    ap.add_argument("--down-s", type=float, default=3.0)
    ap.add_argument("--restart-total-s", type=float, default=10.0)
    ap.add_argument("--appendonly", action="store_true", help="Redis with an append-only file (entries survive)")
    ap.add_argument("--no-pin", action="store_true", help="pin nothing (router, upstream, load generator, Redis)")
    ap.add_argument("--redis-core", choices=["any", "0", "1"], default="any",
                    help="pin Redis too (default: the scheduler places it)")
    ap.add_argument("--redis-nice", type=int, default=0,
                    help="Redis's nice value (e.g. -10: Redis gets the CPU share it would have on a host of its own)")
    ap.add_argument("--upstream", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.upstream:
        run_upstream(args.port)
        return 0
    pin = not args.no_pin and (os.cpu_count() or 1) >= 2
    if pin:
        os.sched_setaffinity(0, {1})  # the load generator shares core 1 with the upstream and Redis
    print(f"started {time.strftime('%H:%M:%S')}, load {load_average():.2f}, pinned: {pin}, "
          f"Redis core {args.redis_core}, nice {args.redis_nice}")
    with Bed(pin, appendonly=args.appendonly, redis_core=args.redis_core, redis_nice=args.redis_nice) as bed:
        if args.part in ("all", "hits"):
            part_hits(bed, args.duration, args.concurrency)
        if args.part in ("all", "ttft"):
            part_ttft(bed, args.duration, args.reps)
        if args.part in ("all", "restart"):
            part_restart(bed, args.kill_at, args.down_s, args.restart_total_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
