"""The deployment config: one TOML file, read and checked here before anything is rendered or launched.

Every error is a :class:`DeployConfigError` whose message starts with the file and the field
(``deploy.toml: prefill.side_channel_port: ...``), so a bad file stops the launch scripts before a
single process starts. The layout, with every default, is ``impl/deploy/deploy.toml``.

Why some rules exist:

* one ``host`` per server is used for its HTTP URL, its NIXL side channel
  (``VLLM_NIXL_SIDE_CHANNEL_HOST``) and the router's ``remote_host`` rewrite, so the three can never
  disagree (the router rewrites ``remote_host`` to the instance's HTTP host, impl/router/app.py);
* a loopback or wildcard host cannot be advertised to the other node, and vLLM's side channel
  defaults to ``localhost`` (vLLM docs, nixl_connector_usage.md, "VLLM_NIXL_SIDE_CHANNEL_HOST");
* the connector table is checked by the connector's own validator
  (:meth:`impl.connector.config.ConnectorSettings.from_extra_config`), so the launch fails here with
  the same message the server would print minutes later, after loading the model.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from calibration.hardware import PRESETS, Hardware, load_hardware
from impl.connector.config import ConfigError as ConnectorConfigError
from impl.policy import catalogue
from impl.connector.config import ConnectorSettings
from impl.deploy.k8s_config import KubernetesSettings, parse_kubernetes
from impl.router.config import url_host

WORKLOADS = ("synthetic", "agentic", "mooncake")
KV_BUFFER_DEVICES = ("cuda", "cpu")
SECTIONS = ("deploy", "model", "prefill", "decode", "transfer", "connector", "host_tier", "router", "bench", "calibrate",
            "kubernetes")

DEFAULT_INSTANCE = PRESETS["p5en"]  # P's and D's instance type: the published setup, two p5en.48xlarge

# EFA settings for NIXL's LIBFABRIC backend (sources in impl/deploy/README.md, "Why these settings"):
# the efa provider rather than whatever libfabric ranks first, and device RDMA required (p4d/p5/p5en
# support RDMA read; with it required, a host without it fails at start instead of silently emulating).
DEFAULT_TRANSFER_ENV = (("FI_PROVIDER", "efa"), ("FI_EFA_USE_DEVICE_RDMA", "1"))

# Connector defaults for GPU hosts. The connector's own defaults are tuned for a 2-core CPU machine
# (impl/connector/README.md): a 1 ms NIXL progress-thread delay and a 5 s idle-step wait each add
# latency that a 192-vCPU p5en does not need to save, so the recipe restores vLLM's behaviour.
# num_threads is added only without UCX (see _connector_extra).
def _key(name: str) -> str:
    return catalogue.setting(name).key()


DEFAULT_CONNECTOR = {
    **{_key(name): catalogue.default(name) for name in ("kv_recompute_threshold", "decoder_kv_blocks_ttl")},  # vLLM's
    _key("nixl_progress_delay_us"): 0,
    _key("idle_step_sleep_s"): 0,
}
# Keys the renderer sets itself; accepting them in [connector] would let the file contradict --mode.
CONNECTOR_KEYS_OWNED = {
    "bidirectional_kv_xfer": "set by --mode on|off",
    "backends": "set it in [transfer] backends",
}
# Environment the renderer computes per server; the [transfer.env] table must not override it.
ENV_OWNED = ("VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT", "CUDA_VISIBLE_DEVICES", "PYTHONPATH",
             "PYTHONHASHSEED")
# vLLM flags the renderer writes; the same flag in extra_args would silently win or clash.
VLLM_FLAGS_OWNED = ("--model", "--served-model-name", "--host", "--port", "--tensor-parallel-size",
                    "--max-model-len", "--kv-transfer-config", "--enable-prefix-caching",
                    "--no-enable-prefix-caching")
_notify = catalogue.setting("notify").flag()
ROUTER_FLAGS_OWNED = ("--prefill", "--decode", "--host", "--port", _notify, "--no-" + _notify[2:], "--notify-url",
                      catalogue.setting("decoder_kv_blocks_ttl").flag(), "--config",
                      *(catalogue.setting(name).flag() for name in ("host_tier_capacity_tokens", "host_tier_p2p_port",
                                                                     "min_cached_token_delta")))

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SSH_TARGET = re.compile(r"^[A-Za-z0-9_.@:\[\]%-]+$")


class DeployConfigError(ValueError):
    """A bad deployment config; ``field`` is the dotted name (``prefill.http_port``)."""

    def __init__(self, source: str, field: str, message: str) -> None:
        super().__init__(f"{source}: {field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Server:
    """One vLLM server: P (``prefill``) or D (``decode``)."""

    role: str
    host: str  # the address the other node, the router and the bench reach this one at
    http_port: int
    side_channel_port: int  # VLLM_NIXL_SIDE_CHANNEL_PORT: NIXL handshake (metadata), not the KV bytes
    listen: str = "0.0.0.0"
    ssh: str = ""  # "" runs the command here; "user@host" runs it over ssh
    gpus: str = ""  # CUDA_VISIBLE_DEVICES; "" leaves it unset (all GPUs)
    extra_args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"http://{url_host(self.host)}:{self.http_port}"


@dataclass(frozen=True)
class Model:
    name: str  # what vLLM loads (HF id or path on the hosts)
    served_name: str  # what clients, the router and the bench call it
    tensor_parallel_size: int
    max_model_len: int  # 0: vLLM's default
    prefix_caching_on_prefill: bool  # the published measurement ran with it OFF on P (the AWS post, README.md)


@dataclass(frozen=True)
class Transfer:
    backends: tuple[str, ...]
    kv_buffer_device: str
    env: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Router:
    host: str  # where the bench and D's connector (notifications) reach the router
    port: int
    listen: str = "0.0.0.0"
    ssh: str = ""
    extra_args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}"


@dataclass(frozen=True)
class Bench:
    conversations: int
    concurrency: int
    seed: int
    workload: str
    workload_config: str  # a TOML with a [workload] table (bidikv simulate's format); "" = built-in
    trace: str  # Mooncake JSONL path on the bench host (workload "mooncake")
    gap_scale: float
    results_dir: str  # relative paths are under deploy.workdir
    ssh: str = ""


@dataclass(frozen=True)
class HostTier:
    """[host_tier]: vLLM's own host tier on P and D (impl/connector/two_tier.py), their P2P ports, and what
    the router needs to send P there (impl/router/host_tier.py)."""

    decode_cpu_bytes_to_use: int  # D's host DRAM for KV: what P pulls from
    prefill_cpu_bytes_to_use: int  # P's: where pulled blocks land before P's GPU
    eviction_policy: str
    decode_p2p_port: int
    prefill_p2p_port: int
    min_cached_token_delta: int
    capacity_tokens: int  # D's tier in KV tokens of [calibrate] base_profile (the router's estimate)


@dataclass(frozen=True)
class DeployConfig:
    source: str
    workdir: str  # the bidikv checkout, same path on every host
    python: str  # interpreter with vllm + nixl + bidikv's deps, same path on every host
    model: Model
    prefill: Server
    decode: Server
    transfer: Transfer
    connector: Mapping[str, Any]  # kv_connector_extra_config minus what --mode and [transfer] set
    connector_settings: ConnectorSettings
    router: Router
    bench: Bench
    base_profile: str
    instance: Hardware  # P's and D's instance type (calibration/data/hardware_<preset>.json)
    kubernetes: KubernetesSettings | None = None  # [kubernetes] (bidikv deploy manifests); None without the table
    host_tier: HostTier | None = None  # [host_tier]; None without the table: HBM retention alone

    @property
    def nodes_per_server(self) -> int:
        """Instances one P or D spans: 1, or TP / GPUs per instance when its TP group spans whole instances."""
        return max(1, self.model.tensor_parallel_size // self.instance.gpus_per_node)

    def results_path(self, name: str) -> str:
        base = Path(self.bench.results_dir)
        if not base.is_absolute():
            base = Path(self.workdir) / base
        return str(base / name)


class _Table:
    """Reads one TOML table: typed getters that name ``section.key`` on error, and a final check
    that nothing unknown was left over (a typo is an error, not a silently ignored setting)."""

    def __init__(self, source: str, section: str, data: Any) -> None:
        if not isinstance(data, dict):
            raise DeployConfigError(source, section, f"must be a table, got {type(data).__name__}")
        self.source, self.section, self.data, self.used = source, section, data, set()

    def fail(self, key: str, message: str) -> DeployConfigError:
        return DeployConfigError(self.source, f"{self.section}.{key}", message)

    def _get(self, key: str, default: Any) -> Any:
        self.used.add(key)
        if key not in self.data:
            if default is _REQUIRED:
                raise self.fail(key, "is required")
            return default
        return self.data[key]

    def text(self, key: str, default: Any = None, *, allow_empty: bool = False) -> str:
        value = self._get(key, _REQUIRED if default is None else default)
        if not isinstance(value, str):
            raise self.fail(key, f"must be a string, got {value!r}")
        if not allow_empty and not value.strip():
            raise self.fail(key, "must not be empty")
        if "\n" in value or "\r" in value or "\0" in value:
            raise self.fail(key, "must be a single line")
        return value

    def integer(self, key: str, default: Any = None, *, minimum: int = 0, maximum: int | None = None) -> int:
        value = self._get(key, _REQUIRED if default is None else default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum \
                or (maximum is not None and value > maximum):
            bound = f"in {minimum}..{maximum}" if maximum is not None else f">= {minimum}"
            raise self.fail(key, f"must be an integer {bound}, got {value!r}")
        return value

    def number(self, key: str, default: float, *, minimum: float = 0.0) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < minimum:
            raise self.fail(key, f"must be a finite number >= {minimum:g}, got {value!r}")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, got {value!r}")
        return value

    def strings(self, key: str, default: tuple[str, ...] = ()) -> tuple[str, ...]:
        value = self._get(key, list(default))
        if not isinstance(value, list) or not all(isinstance(v, str) and v and "\n" not in v for v in value):
            raise self.fail(key, f"must be a list of non-empty single-line strings, got {value!r}")
        return tuple(value)

    def port(self, key: str, default: Any = None) -> int:
        return self.integer(key, default, minimum=1, maximum=65535)

    def host(self, key: str) -> str:
        value = self.text(key).strip()
        if any(c.isspace() for c in value) or "/" in value:
            raise self.fail(key, f"must be a bare host name or IP address, got {value!r}")
        if _is_wildcard(value):
            raise self.fail(key, f"must be an address the other hosts can reach, not the wildcard {value!r} "
                                 "(that is what `listen` is for)")
        return value

    def ssh_target(self, key: str) -> str:
        value = self.text(key, "", allow_empty=True).strip()
        if value and (value.startswith("-") or not _SSH_TARGET.match(value)):
            raise self.fail(key, f"must be empty (run here) or an ssh destination like ubuntu@10.0.1.12, got {value!r}")
        return value

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            raise self.fail(unknown[0], f"unknown setting (known: {', '.join(sorted(self.used))})")


_REQUIRED = object()


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _flags_clash(table: _Table, key: str, args: tuple[str, ...], owned: tuple[str, ...]) -> None:
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in owned:
            raise table.fail(key, f"{flag} is written by the renderer from the config; set it there instead")


def _server(source: str, role: str, data: Any, defaults: Mapping[str, int]) -> Server:
    t = _Table(source, role, data)
    server = Server(
        role=role,
        host=t.host("host"),
        http_port=t.port("http_port", defaults["http_port"]),
        side_channel_port=t.port("side_channel_port", defaults["side_channel_port"]),
        listen=t.text("listen", "0.0.0.0"),
        ssh=t.ssh_target("ssh"),
        gpus=_gpus(t),
        extra_args=t.strings("extra_args"),
    )
    _flags_clash(t, "extra_args", server.extra_args, VLLM_FLAGS_OWNED)
    t.done()
    return server


def _gpus(t: _Table) -> str:
    value = t.text("gpus", "", allow_empty=True).replace(" ", "")
    if value and not re.fullmatch(r"\d+(,\d+)*", value):
        raise t.fail("gpus", f"must be empty or comma-separated GPU indices like \"0,1,2,3\", got {value!r}")
    if value and len(set(value.split(","))) != len(value.split(",")):
        raise t.fail("gpus", f"lists a GPU twice: {value!r}")
    return value


def _transfer(source: str, data: Any) -> Transfer:
    t = _Table(source, "transfer", data)
    backends = t.strings("backends", ("LIBFABRIC",))
    if not backends:
        raise t.fail("backends", "must name at least one NIXL backend (LIBFABRIC for EFA)")
    device = t.text("kv_buffer_device", "cuda")
    if device not in KV_BUFFER_DEVICES:
        raise t.fail("kv_buffer_device", f"must be one of {', '.join(KV_BUFFER_DEVICES)}, got {device!r}")
    raw_env = t._get("env", None)
    if raw_env is None:
        env = DEFAULT_TRANSFER_ENV
    else:
        if not isinstance(raw_env, dict):
            raise t.fail("env", f"must be a table of NAME = \"value\", got {raw_env!r}")
        pairs = []
        for name, value in raw_env.items():
            field = f"env.{name}"
            if not _ENV_NAME.match(name):
                raise t.fail(field, "is not a valid environment variable name")
            if name in ENV_OWNED:
                raise t.fail(field, "is computed per server by the renderer; set the server's host/ports/gpus instead")
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise t.fail(field, f"must be a string or a number, got {value!r}")
            text = str(value)
            if "\n" in text or "\0" in text:
                raise t.fail(field, "must be a single line")
            pairs.append((name, text))
        env = tuple(pairs)
    t.done()
    return Transfer(backends=backends, kv_buffer_device=device, env=env)


def _connector_extra(source: str, data: Any, backends: tuple[str, ...]) -> tuple[dict[str, Any], ConnectorSettings]:
    t = _Table(source, "connector", data)
    for key, why in CONNECTOR_KEYS_OWNED.items():
        if key in t.data:
            raise t.fail(key, f"must not be set here: {why}")
    extra = {**DEFAULT_CONNECTOR, **t.data}
    if "UCX" not in backends and "num_threads" not in extra:
        # Our connector forces num_threads=1 into NIXL's agent config unless the key is set, and NIXL
        # passes num_threads to LIBFABRIC as a posting thread pool; vLLM passes none for non-UCX
        # backends. An explicit 0 keeps vLLM's LIBFABRIC behaviour (serial posting).
        extra["num_threads"] = 0
    try:
        settings = ConnectorSettings.from_extra_config({**extra, "bidirectional_kv_xfer": True,
                                                        "backends": list(backends)})
    except ConnectorConfigError as e:
        raise DeployConfigError(source, f"connector.{e.key}", str(e).split(": ", 1)[1]) from None
    except ValueError as e:  # a policy constructor's own message
        raise DeployConfigError(source, "connector", str(e)) from None
    return extra, settings


def _host_tier(source: str, data: Any, base_profile: str) -> HostTier:
    from calibration.profile import LatencyProfile
    from impl.connector.two_tier import EVICTION_POLICIES

    t = _Table(source, "host_tier", data)
    decode_bytes = t.integer("decode_cpu_bytes_to_use", minimum=1)
    tier = HostTier(
        decode_cpu_bytes_to_use=decode_bytes,
        prefill_cpu_bytes_to_use=t.integer("prefill_cpu_bytes_to_use", minimum=1),
        eviction_policy=t.text("eviction_policy", "lru"),
        decode_p2p_port=t.port("decode_p2p_port", 5710),
        prefill_p2p_port=t.port("prefill_p2p_port", 5711),
        min_cached_token_delta=t.integer("min_cached_token_delta", catalogue.setting("min_cached_token_delta").default,
                                         minimum=0),
        capacity_tokens=0)
    if tier.eviction_policy not in EVICTION_POLICIES:
        raise t.fail("eviction_policy", f"must be one of {', '.join(EVICTION_POLICIES)}, got {tier.eviction_policy!r}")
    t.done()
    try:  # the router counts the tier in tokens: the model's KV bytes per token, from the profile
        per_token = LatencyProfile.load(base_profile).kv_bytes_per_token
    except ValueError as e:
        raise DeployConfigError(source, "calibrate.base_profile", str(e)) from None
    return dataclasses.replace(tier, capacity_tokens=max(1, int(decode_bytes // per_token)))


def _bench(source: str, data: Any) -> Bench:
    t = _Table(source, "bench", data)
    bench = Bench(
        conversations=t.integer("conversations", 24, minimum=1),
        concurrency=t.integer("concurrency", 2, minimum=1),
        seed=t.integer("seed", 0, minimum=0),
        workload=t.text("workload", "synthetic"),
        workload_config=t.text("workload_config", "", allow_empty=True),
        trace=t.text("trace", "", allow_empty=True),
        gap_scale=t.number("gap_scale", 0.0),
        results_dir=t.text("results_dir", "results"),
        ssh=t.ssh_target("ssh"),
    )
    if bench.workload not in WORKLOADS:
        raise t.fail("workload", f"must be one of {', '.join(WORKLOADS)}, got {bench.workload!r}")
    if bench.workload == "mooncake" and not bench.trace:
        raise t.fail("trace", "is required with workload \"mooncake\" (the trace's path on the bench host)")
    if bench.trace and bench.workload != "mooncake":
        raise t.fail("trace", f"is only used with workload \"mooncake\", but workload is {bench.workload!r}")
    t.done()
    return bench


def _flag_value(args: tuple[str, ...], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _check_one_block_size(source: str, config: DeployConfig) -> None:
    """KV blocks cross between P and D as they are: both must use one block size."""
    p, d = (_flag_value(s.extra_args, "--block-size") for s in (config.prefill, config.decode))
    if p != d:
        raise DeployConfigError(source, "decode.extra_args", f"--block-size {d or '(vLLM default)'} differs from "
                                f"prefill.extra_args' {p or '(vLLM default)'}: P and D must use one block size")


def _check_addresses(source: str, config: DeployConfig) -> None:
    p, d, r = config.prefill, config.decode, config.router
    if p.host != d.host:
        for server in (p, d):
            if _is_loopback(server.host):
                raise DeployConfigError(source, f"{server.role}.host",
                                        f"{server.host!r} is loopback, but P and D are on different hosts: the other "
                                        "node could not reach its NIXL side channel")
    listening = [(p.host, p.http_port, "prefill.http_port"), (p.host, p.side_channel_port, "prefill.side_channel_port"),
                 (d.host, d.http_port, "decode.http_port"), (d.host, d.side_channel_port, "decode.side_channel_port"),
                 (r.host, r.port, "router.port")]
    if config.connector_settings.heartbeat_port:  # D's lease-heartbeat listener (P never opens it)
        listening.append((d.host, config.connector_settings.heartbeat_port, f"connector.{_key('heartbeat_port')}"))
    if config.host_tier is not None:  # the P2P tiers' ZMQ control sockets
        listening += [(p.host, config.host_tier.prefill_p2p_port, "host_tier.prefill_p2p_port"),
                      (d.host, config.host_tier.decode_p2p_port, "host_tier.decode_p2p_port")]
    seen: dict[tuple[str, int], str] = {}
    for host, port, field in listening:
        if (host, port) in seen:
            raise DeployConfigError(source, field, f"port {port} on {host} is already {seen[(host, port)]}")
        seen[(host, port)] = field
    if config.model.tensor_parallel_size > 1:
        for server in (p, d):
            if server.gpus and len(server.gpus.split(",")) < config.model.tensor_parallel_size:
                raise DeployConfigError(source, f"{server.role}.gpus",
                                        f"lists {len(server.gpus.split(','))} GPU(s), fewer than "
                                        f"model.tensor_parallel_size = {config.model.tensor_parallel_size}")


def parse_config(data: Mapping[str, Any], source: str = "<config>") -> DeployConfig:
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise DeployConfigError(source, unknown[0], f"unknown section (known: {', '.join(SECTIONS)})")
    for section in ("deploy", "model", "prefill", "decode", "router"):
        if section not in data:
            raise DeployConfigError(source, section, "section is required")

    deploy = _Table(source, "deploy", data["deploy"])
    workdir, python = deploy.text("workdir"), deploy.text("python")
    instance_type = deploy.text("instance_type", DEFAULT_INSTANCE)
    deploy.done()
    try:
        instance = load_hardware(instance_type)
    except ValueError:
        raise DeployConfigError(source, "deploy.instance_type", f"unknown instance type {instance_type!r}: one of "
                                f"{', '.join(PRESETS.values())}") from None

    m = _Table(source, "model", data["model"])
    name = m.text("name")
    model = Model(name=name, served_name=m.text("served_name", name),
                  tensor_parallel_size=m.integer("tensor_parallel_size", 1, minimum=1),
                  max_model_len=m.integer("max_model_len", 0, minimum=0),
                  prefix_caching_on_prefill=m.boolean("prefix_caching_on_prefill", False))
    per_node = instance.gpus_per_node
    if model.tensor_parallel_size > per_node and model.tensor_parallel_size % per_node:
        # a TP group spanning nodes takes whole instances (Kubernetes: a LeaderWorkerSet of TP / per_node pods)
        raise DeployConfigError(source, "model.tensor_parallel_size",
                                f"{model.tensor_parallel_size} exceeds the {per_node} "
                                f"{instance.accelerator or 'accelerators'} of one {instance.name} and is not a "
                                f"multiple of {per_node} (a tensor-parallel group spanning nodes takes whole instances)")
    m.done()

    prefill = _server(source, "prefill", data["prefill"], {"http_port": 8100, "side_channel_port": 5600})
    decode = _server(source, "decode", data["decode"], {"http_port": 8200, "side_channel_port": 5601})
    transfer = _transfer(source, data.get("transfer", {}))
    connector, settings = _connector_extra(source, data.get("connector", {}), transfer.backends)

    rt = _Table(source, "router", data["router"])
    router = Router(host=rt.host("host"), port=rt.port("port", 9000), listen=rt.text("listen", "0.0.0.0"),
                    ssh=rt.ssh_target("ssh"), extra_args=rt.strings("extra_args"))
    _flags_clash(rt, "extra_args", router.extra_args, ROUTER_FLAGS_OWNED)
    rt.done()

    bench = _bench(source, data.get("bench", {}))
    cal = _Table(source, "calibrate", data.get("calibrate", {}))
    base_profile = cal.text("base_profile", "qwen3-32b@p5en-tp8")
    cal.done()

    host_tier = _host_tier(source, data["host_tier"], base_profile) if "host_tier" in data else None
    kubernetes = None
    if "kubernetes" in data:
        kubernetes = parse_kubernetes(_Table(source, "kubernetes", data["kubernetes"]), instance.name)
    config = DeployConfig(source=source, workdir=workdir, python=python, model=model, prefill=prefill,
                          decode=decode, transfer=transfer, connector=connector, connector_settings=settings,
                          router=router, bench=bench, base_profile=base_profile, instance=instance,
                          kubernetes=kubernetes, host_tier=host_tier)
    _check_addresses(source, config)
    _check_one_block_size(source, config)
    return config


def load_config(path: str | Path) -> DeployConfig:
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as e:
        raise DeployConfigError(str(path), "file", e.strerror or str(e)) from None
    except tomllib.TOMLDecodeError as e:
        raise DeployConfigError(str(path), "file", f"not valid TOML ({e})") from None
    return parse_config(data, str(path))


__all__ = ["Bench", "DeployConfig", "DeployConfigError", "HostTier", "Model", "Router", "Server", "Transfer", "load_config",
           "parse_config"]
