"""The router under two hostile loads (a store flood, a connection siege), with the figures printed.

``flood``: a flood of long-context conversations. Every turn is a new conversation whose D answers
with ``--blocks`` block ids (8,000 blocks = 128k tokens at 16 per block; every other id, so the store
cannot keep them as one range: ~32 KB an entry packed, ~290 KB as Python ints). The router's RSS (``/proc/<pid>/status``), the store's counted bytes and entries
(``/metrics``) are sampled every second: with ``--max-store-bytes`` they must plateau at the bound;
``--max-store-bytes 0`` runs with a bound far above the flood to show the growth the bound prevents.

``siege``: ``--idle`` connections that send nothing and ``--slowloris`` connections that send a
request head one byte per second, opened at once, while ``--users`` closed-loop clients keep sending
normal turns. Printed each second: normal turns served and their latency, errors, how many idle and
slowloris connections are still open, the router's ``client_connections`` gauge and RSS. Run with
the router's defaults (10 s head timeout) unless flags say otherwise.

``retention``: tenant B floods the learnt retention. Tenant A runs ``--a-conversations`` conversations that
come back every 3-8 s; after ``--warmup-s`` (A's holds are learnt: its price is re-set every 60 s) and
``--phase-s`` more alone, tenant B sends ``--b-turns`` first turns that never return over the next
``--phase-s``. The router runs ``--learnt-retention-budget-tokens 400
--learnt-retention-min-returns 5 --decoder-kv-blocks-ttl 3605``; D records the hold asked with each
turn. Printed: A's holds before and during B's flood (mean, how many 0), B's, and the router's
``held_tokens`` against the budget at the end of each phase.

``listener``: a give-back D whose heartbeat listener hangs. ``--conversations`` conversations of two
turns; the router asks D to renew each second turn before P reads it (``bidikv_renew_before_read``).
Printed: each reuse turn's time to its answer (JSON, so the whole answer: D answers at once) and the
renewal outcomes; ``--heartbeat-timeout-s`` 3 s is the router's default.

``flood`` and ``siege``: P and D are one scripted raw-asyncio upstream (cheap, so the router is what is
measured), as in benchmarks/router_overhead.py; ``retention`` and ``listener``: an aiohttp P/D in this
process (what is measured there is what the router asks and how long turns wait, not its CPU). Run::

    .venv/bin/python benchmarks/router_hostile.py flood [--conversations 20000] [--max-store-bytes 134217728]
    .venv/bin/python benchmarks/router_hostile.py siege [--idle 2000] [--slowloris 50] [--duration 40]
    .venv/bin/python benchmarks/router_hostile.py retention [--warmup-s 120] [--phase-s 60] [--b-turns 1283]
    .venv/bin/python benchmarks/router_hostile.py listener [--conversations 12]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from router_overhead import RawClient, _json_response, free_port, next_request, wait_http  # noqa: E402  (same directory)

ROOT = Path(__file__).resolve().parents[1]
_REQUEST_IDS = itertools.count()


class ScriptedUpstream(asyncio.Protocol):
    """P (``max_tokens`` 1) and D (anything else, JSON answer with ``BLOCKS`` fresh block ids)."""

    blocks = 2000
    contiguous = False

    def connection_made(self, transport):
        self.transport = transport
        self.buf = b""

    def data_received(self, data):
        self.buf += data
        while True:
            request, self.buf = next_request(self.buf)
            if request is None:
                return
            path, body = request
            if path.startswith(b"/health"):
                self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            elif path.startswith(b"/v1/models"):
                self.transport.write(_json_response({"object": "list", "data": [{"id": "bench", "max_model_len": 131072}]}))
            elif b'"max_tokens":1,' in body or b'"max_tokens": 1,' in body or body.endswith(b'"max_tokens": 1}'):
                self.transport.write(self.prefill())
            else:
                self.transport.write(self.decode())

    def prefill(self) -> bytes:
        return _json_response({"id": "p", "object": "chat.completion", "model": "bench",
                               "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}],
                               "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                                      "remote_block_ids": [[1, 2]], "remote_engine_id": "P",
                                                      "remote_request_id": "p", "remote_host": "127.0.0.1",
                                                      "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 32}})

    def decode(self) -> bytes:
        n = next(_REQUEST_IDS)
        step = 1 if self.contiguous else 2  # every other block: the router's store cannot keep them as one range
        first = (n * self.blocks * step) % 1_000_000_000 + 1000  # fresh ids per turn: the router cannot share them
        return _json_response({"id": "d", "object": "chat.completion", "model": "bench",
                               "choices": [{"index": 0, "message": {"role": "assistant", "content": "answer"},
                                            "finish_reason": "stop"}],
                               "kv_transfer_params": {"do_remote_prefill": False, "do_remote_decode": True,
                                                      "remote_block_ids": [list(range(first, first + step * self.blocks, step))],
                                                      "remote_engine_id": "D", "remote_request_id": f"d-{n}",
                                                      "remote_host": "127.0.0.1", "remote_port": 5700, "tp_size": 1,
                                                      "remote_num_tokens": self.blocks * 16,
                                                      "remote_blocks_expiry_time": time.time() + 480}})


def run_upstream(port: int, blocks: int, contiguous: bool) -> None:
    ScriptedUpstream.blocks = blocks
    ScriptedUpstream.contiguous = contiguous

    async def main():
        server = await asyncio.get_running_loop().create_server(ScriptedUpstream, "127.0.0.1", port, backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def scrape(port: int) -> dict[str, float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    raw = await reader.read()
    writer.close()
    out = {}
    for line in raw.decode().split("\r\n\r\n", 1)[-1].splitlines():
        if line.startswith("bidikv_router_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def turn_body(cid: str) -> bytes:
    return json.dumps({"model": "bench", "messages": [{"role": "user", "content": f"[{cid}] a long document, summarised"}],
                       "max_tokens": 8, "stream": False, "conversation_id": cid}).encode()


def start_router(up_port: int, router_port: int, extra: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "impl.router", "--prefill", f"http://127.0.0.1:{up_port}", "--decode",
           f"http://127.0.0.1:{up_port}", "--host", "127.0.0.1", "--port", str(router_port), "--log-level", "warning",
           "--health-interval-s", "5", "--no-notify", *extra]
    router = subprocess.Popen(cmd, env=env, cwd=ROOT)
    wait_http(router_port)
    return router


# -- flood ------------------------------------------------------------------------------------------
async def flood(router_port: int, pid: int, conversations: int, users: int) -> list[dict]:
    done = 0
    errors = 0
    ids = iter(range(conversations))

    async def user() -> None:
        nonlocal done, errors
        client = RawClient("127.0.0.1", router_port)
        try:
            for i in ids:
                _, _, status = await client.post("/v1/chat/completions", turn_body(f"flood-{i}"))
                done += 1
                errors += status != 200
        finally:
            client.close()

    rows = []
    t0 = time.monotonic()
    tasks = [asyncio.ensure_future(user()) for _ in range(users)]
    while not all(t.done() for t in tasks):
        await asyncio.sleep(1.0)
        m = await scrape(router_port)
        rows.append({"t_s": round(time.monotonic() - t0, 1), "turns": done, "errors": errors,
                     "store_entries": int(m.get("bidikv_router_store_entries", 0)),
                     "store_mb": round(m.get("bidikv_router_store_bytes", 0) / 2**20, 1),
                     "evictions": int(m.get("bidikv_router_store_evictions_total", 0)), "rss_mb": round(rss_mb(pid), 1)})
        print(json.dumps(rows[-1]), flush=True)
    await asyncio.gather(*tasks)
    return rows


# -- siege ------------------------------------------------------------------------------------------
async def siege(router_port: int, pid: int, idle: int, slowloris: int, users: int, duration: float, calm: float) -> list[dict]:
    latencies: list[float] = []
    served = errors = 0
    stop = False

    async def user(uid: int) -> None:
        nonlocal served, errors
        client = RawClient("127.0.0.1", router_port)
        n = 0
        try:
            while not stop:
                n += 1
                t = time.perf_counter()
                try:
                    _, _, status = await client.post("/v1/chat/completions", turn_body(f"u{uid}-{n}"))
                except (OSError, asyncio.IncompleteReadError):
                    client.close()
                    client = RawClient("127.0.0.1", router_port)
                    status = -1
                latencies.append(time.perf_counter() - t)
                served += status == 200
                errors += status != 200
        finally:
            client.close()

    open_idle: set = set()
    open_slow: set = set()

    async def hold_idle() -> None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", router_port)
        except OSError:
            return
        open_idle.add(writer)
        try:
            await reader.read()  # until the router closes it
        except OSError:
            pass
        open_idle.discard(writer)
        writer.close()

    async def hold_slowloris() -> None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", router_port)
        except OSError:
            return
        open_slow.add(writer)
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 10_000
        closed = asyncio.ensure_future(reader.read())
        try:
            for i in range(len(head)):
                if closed.done():
                    break
                writer.write(head[i:i + 1])
                await asyncio.sleep(1.0)
        except OSError:
            pass
        open_slow.discard(writer)
        closed.cancel()
        writer.close()

    rows = []
    users_tasks = [asyncio.ensure_future(user(i)) for i in range(users)]
    t0 = time.monotonic()
    attackers: list[asyncio.Future] = []
    last_served, last_errors, last_lat = 0, 0, 0
    while time.monotonic() - t0 < calm + duration:
        await asyncio.sleep(1.0)
        if not attackers and time.monotonic() - t0 >= calm:
            attackers = [asyncio.ensure_future(hold_idle()) for _ in range(idle)]
            attackers += [asyncio.ensure_future(hold_slowloris()) for _ in range(slowloris)]
        window = sorted(latencies[last_lat:])
        t_scrape = time.perf_counter()
        m = await scrape(router_port)
        scrape_ms = round(1000 * (time.perf_counter() - t_scrape), 1)  # a stalled router shows here first
        rows.append({"t_s": round(time.monotonic() - t0, 1), "phase": "siege" if attackers else "calm",
                     "turns_per_s": served - last_served, "errors": errors - last_errors,
                     "p50_ms": round(1000 * window[len(window) // 2], 2) if window else None,
                     "p99_ms": round(1000 * window[int(len(window) * 0.99)], 2) if window else None,
                     "idle_open": len(open_idle), "slowloris_open": len(open_slow),
                     "router_client_connections": int(m.get("bidikv_router_client_connections", 0)),
                     "closed_header_timeout": int(m.get('bidikv_router_client_connections_closed_total{reason="header_timeout"}', 0)),
                     "refused_over_limit": int(m.get('bidikv_router_client_connections_closed_total{reason="over_limit"}', 0)),
                     "metrics_scrape_ms": scrape_ms, "rss_mb": round(rss_mb(pid), 1)})
        last_served, last_errors, last_lat = served, errors, len(latencies)
        print(json.dumps(rows[-1]), flush=True)
    stop = True
    await asyncio.gather(*users_tasks, return_exceptions=True)
    for a in attackers:
        a.cancel()
    await asyncio.gather(*attackers, return_exceptions=True)
    return rows


# -- retention flood and stuck listener: an aiohttp P/D in this process --------------------------
class ScriptedPD:
    """P and D in one aiohttp app. D records the hold the router asks for each turn (``bidikv_retention_s``)
    with the tenant named in the conversation id; with ``give_back`` it asks to be renewed before reads and
    posts its params to the router with a heartbeat listener, which answers at once or hangs (``stuck``)."""

    def __init__(self, give_back: bool = False) -> None:
        self.give_back = give_back
        self.stuck = False
        self.holds: list[tuple[float, str, float]] = []  # (when, tenant, hold asked)
        self.renewals = 0
        self.port = self.hb_port = 0
        self._runners: list = []
        self._session = None
        self._tasks: set = set()

    async def start(self) -> None:
        import aiohttp
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/health", lambda r: web.Response())
        app.router.add_get("/v1/models", lambda r: web.json_response({"object": "list", "data": [{"id": "bench"}]}))
        app.router.add_post("/v1/chat/completions", self._completion)
        hb = web.Application()
        hb.router.add_post("/bidikv/heartbeat", self._heartbeat)
        for which, application in (("port", app), ("hb_port", hb)):
            runner = web.AppRunner(application, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            setattr(self, which, site._server.sockets[0].getsockname()[1])
            self._runners.append(runner)
        self._session = aiohttp.ClientSession()

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await self._session.close()
        for runner in self._runners:
            await runner.cleanup()

    async def _completion(self, request):
        from aiohttp import web

        body = await request.json()
        params = body.get("kv_transfer_params") or {}
        if body.get("max_tokens") == 1 and params.get("do_remote_decode") and not params.get("do_remote_prefill"):
            return web.json_response({
                "id": "p", "object": "chat.completion", "model": "bench",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 8, "completion_tokens": 1},
                "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
                                       "remote_engine_id": "P", "remote_request_id": f"p-{next(_REQUEST_IDS)}",
                                       "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 8}})
        tenant = str(body.get("messages", [{}])[0].get("content", "?"))[1:2]  # "[A-3] ..." -> "A"
        if "bidikv_retention_s" in params:
            self.holds.append((time.monotonic(), tenant, float(params["bidikv_retention_s"])))
        n = next(_REQUEST_IDS)
        d_params = {"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [[7, 8]],
                    "remote_engine_id": "D", "remote_request_id": f"d-{n}", "remote_host": "127.0.0.1",
                    "remote_port": 5700, "tp_size": 1, "remote_num_tokens": 10,
                    "remote_blocks_expiry_time": time.perf_counter() + (15.0 if self.give_back else 3605.0)}
        if self.give_back:
            d_params["bidikv_renew_before_read"] = True
            spec = params.get("bidikv_notify")
            if spec:
                task = asyncio.get_running_loop().create_task(self._notify(spec, d_params))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        answer = {"id": "d", "object": "chat.completion", "model": "bench",
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": 8, "completion_tokens": 2, "total_tokens": 10}}
        if not self.give_back:  # vLLM 0.33 puts them in the body; the 0.32 path (give-back) only notifies
            answer["kv_transfer_params"] = d_params
        return web.json_response(answer)

    async def _notify(self, spec: dict, d_params: dict) -> None:
        payload = {"turn": spec["turn"], "token": spec["token"], "kv_transfer_params": d_params, "expires_in_s": 480.0,
                   "heartbeat_url": f"http://127.0.0.1:{self.hb_port}/bidikv/heartbeat"}
        async with self._session.post(spec["url"], json=payload) as r:
            await r.read()

    async def _heartbeat(self, request):
        from aiohttp import web

        await request.read()
        self.renewals += 1
        if self.stuck:
            await asyncio.sleep(60.0)
        return web.json_response({"status": "held", "renewed": True, "retention": "ttl",
                                  "expiry_time": time.perf_counter() + 15.0, "expires_in_s": 480.0})


async def _chat(client, path_key: str | None, cid: str, messages: list) -> tuple[float, int, dict]:
    import aiohttp  # noqa: F401

    body = {"model": "bench", "messages": messages, "max_tokens": 4, "stream": False, "conversation_id": cid}
    headers = {"Authorization": f"Bearer {path_key}"} if path_key else {}
    t0 = time.perf_counter()
    async with client.post("/v1/chat/completions", json=body, headers=headers) as r:
        await r.read()
        return time.perf_counter() - t0, r.status, dict(r.headers)


def _hold_summary(holds: list[float]) -> dict:
    return {"turns": len(holds), "mean_hold_s": round(statistics.mean(holds), 1) if holds else None,
            "held_0_s": sum(h == 0.0 for h in holds)}


async def retention(router_port: int, pd: ScriptedPD, a_conversations: int, b_turns: int, phase_s: float,
                    warmup_s: float) -> dict:
    import random

    import aiohttp

    rng = random.Random(49)
    metrics: dict[str, dict] = {}
    async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{router_port}") as client:
        t0 = time.monotonic() + warmup_s  # the measured phases start here
        end = t0 + 2 * phase_s

        async def tenant_a(c: int) -> None:
            messages = [{"role": "user", "content": f"[A-{c}] first"}]
            while time.monotonic() < end:
                _, status, _ = await _chat(client, "key-a", f"A-{c}", messages)
                messages = messages + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
                await asyncio.sleep(rng.uniform(3.0, 8.0))

        async def tenant_b() -> None:
            await asyncio.sleep(warmup_s + phase_s)
            gap = phase_s / b_turns
            for i in range(b_turns):
                await _chat(client, "key-b", f"B-{i}", [{"role": "user", "content": f"[B-{i}] never again"}])
                await asyncio.sleep(gap)

        async def sample() -> None:
            for phase in ("alone", "flood"):
                await asyncio.sleep(warmup_s + phase_s - 0.5 if phase == "alone" else phase_s)
                m = await scrape(router_port)
                metrics[phase] = {k.split("figure=")[1].strip('"}'): v for k, v in m.items()
                                  if k.startswith("bidikv_router_learnt_retention{")}

        await asyncio.gather(*(tenant_a(c) for c in range(a_conversations)), tenant_b(), sample())
    split = t0 + phase_s
    a_alone = [h for t, who, h in pd.holds if who == "A" and t0 <= t < split]
    a_flood = [h for t, who, h in pd.holds if who == "A" and t >= split]
    b = [h for t, who, h in pd.holds if who == "B"]
    return {"summary": "retention", "a_alone": _hold_summary(a_alone), "a_during_flood": _hold_summary(a_flood),
            "b_flood": _hold_summary(b), "router_figures_end_of_alone": metrics.get("alone"),
            "router_figures_end_of_flood": metrics.get("flood")}


async def listener(router_port: int, pd: ScriptedPD, conversations: int) -> dict:
    import aiohttp

    times, statuses = [], []
    async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{router_port}") as client:
        for c in range(conversations):
            first = [{"role": "user", "content": f"[L-{c}] first"}]
            await _chat(client, None, f"L-{c}", first)
            await asyncio.sleep(0.3)  # D's notification lands
            pd.stuck = True
            took, status, headers = await _chat(client, None, f"L-{c}", first + [
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}])
            pd.stuck = False
            times.append(took)
            statuses.append((status, headers.get("X-Bidikv-Reuse-Offered-Tokens")))
            print(json.dumps({"conversation": c, "reuse_turn_s": round(took, 3), "status": status,
                              "offered_tokens": headers.get("X-Bidikv-Reuse-Offered-Tokens")}), flush=True)
        m = await scrape(router_port)
    outcomes = {k.split('outcome="')[1].rstrip('"}'): int(v) for k, v in m.items()
                if k.startswith("bidikv_router_give_back_renewals_total{")}
    return {"summary": "listener", "reuse_turns": len(times), "reuse_turn_s_mean": round(statistics.mean(times), 3),
            "reuse_turn_s_max": round(max(times), 3), "reuse_turns_over_1s": sum(t > 1.0 for t in times),
            "renewal_outcomes": outcomes, "listener_requests": pd.renewals}


def run_in_process(mode: str, args: argparse.Namespace) -> None:
    router_port = free_port()

    async def main() -> dict:
        pd = ScriptedPD(give_back=mode == "listener")
        await pd.start()
        extra = args.router_args.split()
        if mode == "retention":
            flags = ["--learnt-retention-budget-tokens", "400", "--learnt-retention-min-returns", "5",
                     "--decoder-kv-blocks-ttl", "3605", "--open-metrics", *extra]
        else:
            flags = [*extra]
        env = dict(os.environ, PYTHONPATH=str(ROOT), BIDIKV_API_KEYS="tenantA=key-a,tenantB=key-b")
        if mode == "listener":
            env.pop("BIDIKV_API_KEYS")
        cmd = [sys.executable, "-m", "impl.router", "--prefill", f"http://127.0.0.1:{pd.port}", "--decode",
               f"http://127.0.0.1:{pd.port}", "--host", "127.0.0.1", "--port", str(router_port), "--log-level", "warning",
               "--health-interval-s", "5", *flags]
        if mode == "retention":
            cmd.append("--no-notify")
        router = subprocess.Popen(cmd, env=env, cwd=ROOT)
        try:
            await asyncio.get_running_loop().run_in_executor(None, wait_http, router_port)
            print(f"# {mode}: router flags {flags}, load {os.getloadavg()[0]:.2f}", flush=True)
            if mode == "retention":
                return await retention(router_port, pd, args.a_conversations, args.b_turns, args.phase_s, args.warmup_s)
            return await listener(router_port, pd, args.conversations)
        finally:
            router.send_signal(signal.SIGTERM)
            try:
                router.wait(10)
            except subprocess.TimeoutExpired:
                router.kill()
            await pd.stop()

    result = asyncio.run(main())
    result["load_1min_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["flood", "siege", "retention", "listener"])
    ap.add_argument("--conversations", type=int, default=None,
                    help="flood: conversations, one turn each (default 20000); listener: two-turn conversations (12)")
    ap.add_argument("--a-conversations", type=int, default=8, help="retention: tenant A's returning conversations")
    ap.add_argument("--b-turns", type=int, default=1283, help="retention: tenant B's first turns that never return")
    ap.add_argument("--phase-s", type=float, default=60.0, help="retention: seconds of A alone, then of B's flood")
    ap.add_argument("--warmup-s", type=float, default=120.0, help="retention: seconds of A alone before the measured ones")
    ap.add_argument("--blocks", type=int, default=None,
                    help="block ids in each of D's answers (default: 8000 -- a 128k-token context -- for flood, 16 for "
                         "siege, whose RSS is then the connections' and not the store's)")
    ap.add_argument("--contiguous", action="store_true",
                    help="D's block ids one contiguous run (the store keeps it as a range); default every other id")
    ap.add_argument("--max-store-bytes", type=int, default=128 * 2**20,
                    help="flood: the router's bound (0: a bound far above the flood, to show the growth it prevents)")
    ap.add_argument("--users", type=int, default=8, help="closed-loop clients sending normal turns")
    ap.add_argument("--idle", type=int, default=2000, help="siege: connections that send nothing")
    ap.add_argument("--slowloris", type=int, default=50, help="siege: connections sending a head at 1 byte/s")
    ap.add_argument("--duration", type=float, default=40.0, help="siege: seconds under attack")
    ap.add_argument("--calm", type=float, default=5.0, help="siege: seconds of normal load before the attack")
    ap.add_argument("--router-args", default="", help="extra router flags, space separated")
    ap.add_argument("--upstream", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.conversations is None:
        args.conversations = 20_000 if args.mode == "flood" else 12
    if args.blocks is None:
        args.blocks = 8000 if args.mode == "flood" else 16
    if args.mode in ("retention", "listener") and not args.upstream:
        run_in_process(args.mode, args)
        return 0
    if args.upstream:
        run_upstream(args.port, args.blocks, args.contiguous)
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the siege's sockets are ours too
    up_port, router_port = free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    upstream = subprocess.Popen([sys.executable, __file__, "--upstream", "--port", str(up_port), "--blocks", str(args.blocks),
                                 *(["--contiguous"] if args.contiguous else []), "flood"], env=env)
    router = None
    try:
        wait_http(up_port)
        extra = args.router_args.split()
        if args.mode == "flood":
            bound = args.max_store_bytes or 64 * 2**30
            router = start_router(up_port, router_port, ["--max-store-bytes", str(bound), *extra])
            print(f"# flood: {args.conversations} conversations x {args.blocks} blocks, max_store_bytes={bound}, "
                  f"router RSS at start {rss_mb(router.pid):.1f} MB, load {os.getloadavg()[0]:.2f}", flush=True)
            rows = asyncio.run(flood(router_port, router.pid, args.conversations, args.users))
            third = max(1, len(rows) // 3)
            mid, last = rows[third:2 * third], rows[2 * third:]
            print(json.dumps({"summary": "flood", "turns": rows[-1]["turns"], "errors": rows[-1]["errors"],
                              "rss_mb_first": rows[0]["rss_mb"], "rss_mb_max": max(r["rss_mb"] for r in rows),
                              "rss_mb_mid_third_mean": round(statistics.mean(r["rss_mb"] for r in mid), 1) if mid else None,
                              "rss_mb_last_third_mean": round(statistics.mean(r["rss_mb"] for r in last), 1),
                              "store_mb_max": max(r["store_mb"] for r in rows), "bound_mb": round(bound / 2**20, 1),
                              "load_1min_end": round(os.getloadavg()[0], 2)}), flush=True)
        else:
            router = start_router(up_port, router_port, extra)
            print(f"# siege: {args.idle} idle + {args.slowloris} slowloris connections after {args.calm:g} s, "
                  f"{args.users} users, router flags {extra or 'defaults'}, load {os.getloadavg()[0]:.2f}", flush=True)
            rows = asyncio.run(siege(router_port, router.pid, args.idle, args.slowloris, args.users, args.duration, args.calm))
            calm = [r for r in rows if r["phase"] == "calm"]
            hit = [r for r in rows if r["phase"] == "siege"]
            print(json.dumps({"summary": "siege", "calm_turns_per_s": round(statistics.mean(r["turns_per_s"] for r in calm), 1) if calm else None,
                              "siege_turns_per_s": round(statistics.mean(r["turns_per_s"] for r in hit), 1),
                              "siege_min_turns_per_s": min(r["turns_per_s"] for r in hit),
                              "siege_errors": sum(r["errors"] for r in hit),
                              "siege_p99_ms_max": max((r["p99_ms"] or 0) for r in hit),
                              "first_s_with_no_idle_open": next((r["t_s"] - args.calm for r in hit if r["idle_open"] == 0), None),
                              "first_s_with_no_slowloris_open": next((r["t_s"] - args.calm for r in hit if r["slowloris_open"] == 0), None),
                              "rss_mb_max": max(r["rss_mb"] for r in rows), "load_1min_end": round(os.getloadavg()[0], 2)}),
                  flush=True)
    finally:
        for p in (router, upstream):
            if p is not None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
