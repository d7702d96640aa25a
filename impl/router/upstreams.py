"""Upstream vLLM instances: who they are, how loaded, whether alive, and which one serves a turn.

The choice itself is impl.policy's placement, verbatim; this module only feeds it load snapshots
(requests in flight and estimated prompt tokens in flight, which the router sees without asking)
and hides dead instances. Liveness is active and passive: every ``health_interval_s`` each instance's
``GET /health`` is probed (vLLM answers 200 when its engine is up) and ``health_failures_to_down``
consecutive failures take it out (one slow answer from a busy server does not); an instance the
router could not connect to is marked down at once, so traffic moves off it without waiting for the
next probe; a probe that succeeds brings it back.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field
from typing import Iterable, Mapping
from urllib.parse import urlsplit

import aiohttp

from impl.policy import InstanceLoad, PlacementPolicy, PlacementRequest
from impl.policy.catalogue import PLACEMENT, ROUTER

log = logging.getLogger("bidikv.router")


@dataclass(slots=True, eq=False)
class Upstream:
    role: str  # "prefill" | "decode"
    base_url: str
    host: str = field(init=False)  # HTTP host, used to rewrite remote_host like vLLM's proxy
    chat_url: str = field(init=False)
    completions_url: str = field(init=False)
    healthy: bool = True
    failed_probes: int = 0  # consecutive
    in_flight: int = 0
    in_flight_tokens: int = 0
    downs: int = 0  # times it left rotation: it may have restarted since (its host tier then empty)

    def __post_init__(self) -> None:
        self.host = urlsplit(self.base_url).hostname or "localhost"
        self.chat_url = self.base_url + "/v1/chat/completions"
        self.completions_url = self.base_url + "/v1/completions"

    @property
    def name(self) -> str:
        return self.base_url

    def url_for(self, endpoint: str) -> str:
        return self.chat_url if endpoint == "chat" else self.completions_url


def make_placement(name: str) -> PlacementPolicy:
    """The catalogue's placement policy of that name (impl.policy.catalogue.PLACEMENT)."""
    if name not in PLACEMENT.names(ROUTER):
        raise ValueError(f"unknown placement {name!r}")
    return PLACEMENT.build(name, {})


class UpstreamPool:
    """The instances of one role and the placement policy that chooses among them."""

    def __init__(self, role: str, urls: Iterable[str], policy: PlacementPolicy, rng: random.Random) -> None:
        self.role = role
        self.instances = [Upstream(role, u) for u in urls]
        self._by_name = {u.name: u for u in self.instances}
        self.policy = policy
        self.rng = rng

    def __iter__(self):
        return iter(self.instances)

    @property
    def healthy_count(self) -> int:
        return sum(1 for u in self.instances if u.healthy)

    def pick(self, prompt_tokens: int, exclude: set[str] | frozenset[str] = frozenset(),
             remote_reusable_tokens: int = 0, cached_tokens: Mapping[str, int] | None = None) -> Upstream | None:
        if len(self.instances) == 1:  # the common 1P1D case, without building snapshots
            only = self.instances[0]
            return only if only.healthy and only.name not in exclude else None
        loads = [
            InstanceLoad(u.name, healthy=u.healthy and u.name not in exclude,
                         queued_prefill_tokens=u.in_flight_tokens, running_requests=u.in_flight)
            for u in self.instances
        ]
        request = PlacementRequest(prompt_tokens=max(0, prompt_tokens), cached_tokens=cached_tokens or {},
                                   remote_reusable_tokens=remote_reusable_tokens)
        name = self.policy.pick(loads, request, self.rng)
        return None if name is None else self._by_name[name]

    def mark_down(self, upstream: Upstream, why: str) -> None:
        if upstream.healthy:
            log.warning("%s %s marked down: %s", self.role, upstream.name, why)
            upstream.downs += 1
        upstream.healthy = False


class HealthProber:
    """Probes every instance's ``/health`` on a fixed interval; flips ``healthy`` both ways."""

    def __init__(self, pools: Iterable[UpstreamPool], session: aiohttp.ClientSession, interval_s: float, timeout_s: float,
                 failures_to_down: int = 1) -> None:
        self.pools = list(pools)
        self.session = session
        self.interval_s = interval_s
        self.failures_to_down = failures_to_down
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._task: asyncio.Task | None = None

    async def probe(self, upstream: Upstream) -> bool:
        try:
            async with self.session.get(upstream.base_url + "/health", timeout=self.timeout) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def probe_all(self) -> None:
        instances = [(pool, u) for pool in self.pools for u in pool]
        results = await asyncio.gather(*(self.probe(u) for _, u in instances))
        for (pool, u), ok in zip(instances, results):
            if ok:
                if not u.healthy:
                    log.info("%s %s is back", pool.role, u.name)
                u.healthy, u.failed_probes = True, 0
                continue
            u.failed_probes += 1
            if u.healthy and u.failed_probes >= self.failures_to_down:
                log.warning("%s %s failed %d health probes in a row", pool.role, u.name, u.failed_probes)
                u.healthy = False
                u.downs += 1

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.probe_all()
            except Exception:  # never let one bad probe end probing
                log.exception("health probing failed")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="bidikv-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
