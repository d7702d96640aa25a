"""vLLM's multi-turn benchmark clients: which conversation each client sends next, and when the run stops.

Read from ``benchmark_serving_multi_turn.py`` (``client_main``, ``get_client_config``, ``main_mp``;
https://github.com/vllm-project/vllm/blob/00d395390c6da9baf1080664e8120d9e39956c5e/benchmarks/multi_turn/benchmark_serving_multi_turn.py).
The rule is plain data in, decision out (:class:`VllmClient`), so the simulator (:func:`start`, simpy)
and ``bidikv bench`` (:mod:`sim.bench.vllm_clients`, asyncio) run the same one:

* ``--num-clients`` N (default 1) clients share one queue of conversations in file order, followed by
  one end-of-work signal per client.
* ``--max-active-conversations`` K is for all clients (default N); each client keeps up to K // N
  active (vLLM refuses K < N and K > the number of conversations).
* At the top of each iteration a client stops if it reached its request limit (``--max-num-requests``
  // N) or the stop signal is set; it then tops its active set up from the queue. **If it meets the
  end-of-work signal it stops at once, even with conversations still active** (they are abandoned,
  never finished); it also stops when nothing is active.
* Round robin (``--conversation-sampling round_robin``, the default): a deque of active ids; newly taken
  conversations go on the right, the next request pops from the right, an unfinished conversation
  goes back on the left. A new conversation is therefore served first, then the old ones in turn.
* A conversation is finished once its messages are used up (or ``--max-turns`` messages, counting
  the user message and the answer of each request); a request that fails (an HTTP error) drops its
  conversation; an exception (timeout, connection) also stops the client.
* Early stop (default; ``--no-early-stop`` turns it off): as soon as one client stops, every other
  client stops before its next request (its request in flight completes and is counted). With
  ``--no-early-stop`` each client runs until its own stop rule.
* No think time, unless ``--request-rate`` R > 0: after each request a client sleeps an exponential
  time of mean 1/R minus the request's duration, when that is positive.
* Requests ask for ``max_tokens`` only (the dataset's answer length); no ``min_tokens``.

Not reproduced: ``--conversation-sampling random``, ``--warmup-step``, retries (``--max-retries``)
and the seconds the main process takes to notice a client stopped (the stop is immediate here). At
time 0 clients take their first conversations in client order (in vLLM the processes race for them).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Generator, Sequence

from sim.workload.model import Conversation, Lineage

if TYPE_CHECKING:
    import simpy

    from sim.engine.cluster import Cluster


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True)
class VllmClientConfig:
    """vLLM's client flags (same names), the one source of their defaults; ``num_clients`` is the
    simulator's own ``--num-clients`` (SimConfig.num_clients) or the bench's."""

    max_active_conversations: int = _f(0, "vLLM's --max-active-conversations: active conversations over all clients, "
                                          "each client keeping this // --num-clients, served round robin "
                                          "(0 = --num-clients, vLLM's default)")
    early_stop: bool = _f(True, "vLLM's early stop: the run ends as soon as one client stops (it stops when it needs "
                                "a new conversation and none is left); --no-early-stop lets every client finish")
    max_num_requests: int = _f(0, "vLLM's --max-num-requests: requests over all clients, each client sending this "
                                  "// --num-clients (0 = no limit)")
    max_turns: int = _f(0, "vLLM's --max-turns: messages per conversation, user and answer counted "
                           "(0 = no limit)")
    request_rate: float = _f(0.0, "vLLM's --request-rate: per client, sleep an exponential time of mean "
                                  "1/rate minus the request's duration after each request (0 = back to back)")

    def __post_init__(self) -> None:
        for name in ("max_active_conversations", "max_num_requests", "max_turns"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.early_stop, bool):
            raise ValueError(f"early_stop must be true or false, got {self.early_stop!r}")
        rate = self.request_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < math.inf:
            raise ValueError(f"request_rate must be a finite number >= 0, got {rate!r}")


CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(VllmClientConfig))


def config_from_workload(spec: Mapping[str, object]) -> VllmClientConfig:
    """The client flags a ``vllm_multi_turn`` [workload] table carries (its other keys are the file's)."""
    from sim.workload.spec import config_from_spec

    return config_from_spec(VllmClientConfig, {k: v for k, v in spec.items() if k in CONFIG_KEYS}, "workload")


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """What each client may do, from the flags and vLLM's checks (get_client_config)."""

    num_clients: int
    active_per_client: int
    requests_per_client: int | None
    max_messages: int | None
    request_rate: float
    early_stop: bool


def client_limits(config: VllmClientConfig, num_clients: int, num_conversations: int) -> ClientLimits:
    """vLLM's checks, each error naming the flag; ``num_clients`` 0 is vLLM's default of 1."""
    clients = num_clients or 1
    if num_conversations < clients:
        raise ValueError(f"--num-clients {clients} needs at least as many conversations, the workload has "
                         f"{num_conversations}")
    requests = None
    if config.max_num_requests:
        requests = config.max_num_requests // clients
        if requests < 1:
            raise ValueError(f"--max-num-requests {config.max_num_requests} must be at least one per client "
                             f"(--num-clients {clients})")
    active = config.max_active_conversations or clients
    if active > num_conversations:
        raise ValueError(f"--max-active-conversations {active} must be <= the number of conversations "
                         f"({num_conversations})")
    if active // clients < 1:
        raise ValueError(f"--max-active-conversations {active} must be >= --num-clients {clients}")
    return ClientLimits(clients, active // clients, requests, config.max_turns or None, float(config.request_rate),
                        config.early_stop)


class SharedQueue:
    """The conversations every client takes from, in order, and the run's stop signal."""

    def __init__(self, conversations: Sequence[Conversation], early_stop: bool) -> None:
        self._pending = collections.deque(conversations)
        self.early_stop = early_stop
        self.stopped = False

    def take(self) -> Conversation | None:
        """The next conversation, or None: this client's end-of-work signal."""
        return self._pending.popleft() if self._pending else None

    def client_exited(self) -> None:
        if self.early_stop:
            self.stopped = True


class VllmClient:
    """One client's loop (vLLM's client_main) as decisions: :meth:`next_request`, then :meth:`done`."""

    def __init__(self, client_id: int, limits: ClientLimits, queue: SharedQueue, rng: random.Random) -> None:
        self.client_id = client_id
        self._limits, self._queue, self._rng = limits, queue, rng
        self._active: dict[str, Conversation] = {}
        self._order: collections.deque[str] = collections.deque()
        self._sent: collections.Counter[str] = collections.Counter()  # requests sent per conversation
        self._queue_empty = False
        self.requests = 0
        self.exit_reason = ""
        self._current: Conversation | None = None

    def next_request(self) -> tuple[Conversation, int] | None:
        """The conversation and request index to send next, or None: the client stops (see exit_reason)."""
        limits = self._limits
        if limits.requests_per_client is not None and self.requests == limits.requests_per_client:
            return self._exit("request limit")
        if self._queue.stopped:
            return self._exit("stopped early (another client stopped)")
        while len(self._active) < limits.active_per_client and not self._queue_empty:
            conv = self._queue.take()
            if conv is None:
                self._queue_empty = True
                break
            self._active[conv.conversation_id] = conv
            self._order.append(conv.conversation_id)
        if not self._active or self._queue_empty:
            return self._exit("no conversation left to take" if self._queue_empty else "no active conversation")
        conv = self._active[self._order.pop()]
        self._current = conv
        return conv, self._sent[conv.conversation_id]

    def done(self, ok: bool, exception: bool = False) -> bool:
        """Record the outcome of the request :meth:`next_request` returned; False: the client stops now
        (an exception, as vLLM's client leaves its loop on one). ``ok`` False drops the conversation."""
        conv, self._current = self._current, None
        if conv is None:
            raise RuntimeError("done() without a request from next_request()")
        self.requests += 1
        key = conv.conversation_id
        if not ok:
            del self._active[key]
            if exception:
                self._exit("request raised")
                return False
            return True
        self._sent[key] += 1
        messages = 2 * len(conv.turns)
        if self._limits.max_messages is not None:
            messages = min(messages, self._limits.max_messages)
        if 2 * self._sent[key] >= messages:
            del self._active[key]  # finished
        else:
            self._order.appendleft(key)
        return True

    def pause_s(self, request_s: float) -> float:
        """Seconds to sleep after a request that took ``request_s`` (vLLM's poisson_sleep)."""
        if self._limits.request_rate <= 0:
            return 0.0
        mean = 1.0 / self._limits.request_rate - request_s
        return self._rng.expovariate(1.0 / mean) if mean > 0 else 0.0

    def _exit(self, reason: str) -> None:
        self.exit_reason = reason
        self._queue.client_exited()
        return None


def make_clients(config: VllmClientConfig, num_clients: int, conversations: Sequence[Conversation],
                 seed: int) -> list[VllmClient]:
    """The clients of one run over one shared queue; client i's sleeps use stream ``vllm-client:<i>``."""
    from sim.engine.rng import stream

    limits = client_limits(config, num_clients, len(conversations))
    queue = SharedQueue(conversations, limits.early_stop)
    return [VllmClient(i, limits, queue, stream(seed, f"vllm-client:{i}")) for i in range(limits.num_clients)]


def start(cluster: "Cluster", conversations: Sequence[Conversation], config: VllmClientConfig,
          num_clients: int, seed: int) -> int:
    """Start the clients as simpy processes on ``cluster`` (its ``run(clients=...)`` hook); returns how many."""
    clients = make_clients(config, num_clients, conversations, seed)
    lineages: dict[str, Lineage] = {}
    for client in clients:
        cluster.env.process(_sim_client(cluster, client, lineages))
    return len(clients)


def _sim_client(cluster: "Cluster", client: VllmClient,
                lineages: dict[str, Lineage]) -> Generator["simpy.Event", Any, None]:
    env = cluster.env
    while (request := client.next_request()) is not None:
        conv, index = request
        lineage = lineages.get(conv.conversation_id)
        if lineage is None:
            lineage = lineages[conv.conversation_id] = Lineage(conv.turns)
        started = env.now
        record = yield from cluster.serve_turn(conv, index, lineage)
        client.done(ok=not record.rejected)
        pause = client.pause_s(env.now - started)
        if pause > 0:
            yield env.timeout(pause)
    cluster.client_exited()  # the sampler and heartbeats run while any client does (Cluster.run's hook)
