"""Router settings: one dataclass, one source of defaults.

Precedence: the dataclass defaults < a TOML file (``--config``; top-level keys or a ``[router]``
table, named like the fields) < command-line flags. The CLI builds its flags from :data:`FLAG_HELP`
and leaves every default to this dataclass, so nobody writes a default twice. Secrets never go in
the file or on the command line: fields ending in ``_env`` name environment variables.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from typing import Any, Mapping

from impl.policy import catalogue
from impl.policy.catalogue import PLACEMENT, PREFILL_ON_D, ROUTER
from impl.policy.prefill_on_d import PrefillOnD
from impl.router.stores import check_store_url

PLACEMENTS = PLACEMENT.names(ROUTER)
_d = catalogue.default  # the catalogue's settings (impl/policy/catalogue.py) take their default from it


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...] = ()  # base URLs of prefill instances, e.g. http://10.0.0.1:8100
    decode: tuple[str, ...] = ()  # base URLs of decode instances
    host: str = "0.0.0.0"
    port: int = 8000
    # API keys: a file of "<tenant> <key>" lines and/or an env var "tenant=key,tenant=key".
    # With neither configured there is one tenant, "default", and no authentication.
    api_keys_file: str | None = None
    api_keys_env: str = "BIDIKV_API_KEYS"
    metrics_token_env: str = "BIDIKV_METRICS_TOKEN"  # if that variable is set, /metrics needs it
    # With API keys and no metrics token, /metrics is refused: its counters move with every tenant's
    # traffic, so a tenant reading them learns about the others. Opt in to serve them open.
    open_metrics: bool = False
    upstream_api_key_env: str = "BIDIKV_UPSTREAM_API_KEY"  # sent to vLLM as a Bearer token
    max_conversations: int = 100_000  # store bound (LRU beyond it)
    # ...and in bytes: an entry grows with D's block ids (as Python ints ~80 KB at 2,000 blocks, 32k
    # tokens: 100k entries could take ~8 GB). The store packs them (a run as a range, else 4 bytes an
    # id), ~10 KB for 2,000 scattered ids; 512 MiB keeps a router on a 2 GB VM with ~50k such
    # conversations, or the 100k bound first for contiguous or short ones
    max_store_bytes: int = 512 * 1024 * 1024
    max_body_bytes: int = 8 * 1024 * 1024
    # Client connections (impl.router.connections says why each exists). A head is a few hundred
    # bytes: 10 s is generous on any link and bounds a slowloris head. 30 s for the whole body: a
    # chat request is KBs; the 8 MB maximum needs ~2.2 Mbit/s to make it. Idle keep-alive 30 s:
    # longer than common client pools keep idle connections (httpx 5 s, aiohttp 15 s), so the router
    # does not close one a client is about to reuse, short enough that idle sockets do not pile up.
    # 4096 connections: twice the 2,000-idle-connection flood of benchmarks/router_hostile.py plus headroom; the soft fd limit is raised
    # to fit (and a warning logged if the hard limit does not allow it).
    client_header_timeout_s: float = 10.0
    client_body_timeout_s: float = 30.0
    client_idle_timeout_s: float = 30.0
    # a client that takes none of our bytes for 60 s (its socket buffers full) is cut: a minute covers
    # any live reader on a bad link, and a stream nobody reads must not hold D's connection forever
    client_write_timeout_s: float = 60.0
    max_client_connections: int = 4096
    max_conversation_id_len: int = 256
    # A request without a conversation id is looked up by the history it resends (impl.policy.history_key):
    # at most this many keys, the most recent first (0: only requests that name their conversation reuse)
    history_lookups: int = 8
    # The per-turn trace (impl.trace.format; impl.router.trace_writer): off unless a directory is given.
    # Names are keyed hashes under the salt in $trace_salt_env (one salt for a fleet joins its replicas'
    # files); 64 MiB x 24 files bounds the disk (~300k turns a file at ~220 bytes a line)
    trace_out: str | None = None
    trace_salt_env: str = "BIDIKV_TRACE_SALT"
    trace_sample_rate: float = 1.0
    trace_max_file_bytes: int = 64 * 1024 * 1024
    trace_rotate_s: float = 3600.0
    trace_max_files: int = 24
    # 0: learnt from the instances' /v1/models (vLLM reports each model's max_model_len); a request
    # asking for more is refused here instead of reaching P and D
    max_model_len: int = 0
    expose_upstream_urls: bool = False  # debug: X-Bidikv-Prefill/-Decode carry URLs instead of instance names
    placement: str = _d("placement")
    seed: int = 0  # placement tie-breaking
    health_interval_s: float = 2.0
    health_timeout_s: float = 3.0  # a busy vLLM can answer /health late; that alone is not death
    health_failures_to_down: int = 2  # consecutive failed probes before an instance leaves rotation
    connect_timeout_s: float = 3.0
    prefill_timeout_s: float = 600.0  # whole P request (a long prompt's prefill)
    decode_idle_timeout_s: float = 300.0  # longest silence allowed between D's bytes
    upstream_max_connections: int = 0  # per upstream instance; 0 = unbounded keep-alive pool
    upstream_keepalive_s: float = 4.0  # below vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s): never reuse a closed one
    notify: bool = _d("notify")  # ask D's connector to post its kv_transfer_params (vLLM 0.32 path)
    notify_url: str | None = None  # URL D uses to reach /internal/kv_params; derived if unset
    notify_wait_s: float = 2.0  # how long after D's stream ends to wait for that notification
    decoder_kv_blocks_ttl: float = _d("decoder_kv_blocks_ttl")  # must equal D's decoder_kv_blocks_ttl
    # learnt per-turn retention (impl.router.retention): off at 0; the KV tokens, summed over all D, that
    # the holds the router asks for may keep retained on average
    learnt_retention_budget_tokens: float = _d("learnt_retention_budget_tokens")
    learnt_retention_min_returns: int = _d("learnt_retention_min_returns")
    learnt_retention_fallback_s: float = _d("learnt_retention_fallback_s")
    expiry_margin_s: float = _d("expiry_margin_s")
    # D's host tier (vLLM's OffloadingConnector; impl.router.host_tier): off at capacity 0
    host_tier_capacity_tokens: int = _d("host_tier_capacity_tokens")
    host_tier_p2p_port: int = _d("host_tier_p2p_port")
    min_cached_token_delta: int = _d("min_cached_token_delta")
    heartbeat_timeout_s: float = 3.0  # a relayed heartbeat's whole round trip to D (D answers within ~2 s or 503)
    heartbeat_retry_s: float = 10.0  # a listener that timed out or refused is not asked again this long
    rewrite_remote_host: bool = True  # replace remote_host by the instance's HTTP host, as vLLM's proxy does
    tenant_cache_salt: bool = True  # with API keys: P's and D's prefix caches are shared only within a tenant
    # where conversations live: "memory" (this process) or redis://HOST:PORT/DB, shared by replicas
    store: str = "memory"
    store_password_env: str = "BIDIKV_STORE_PASSWORD"  # Redis password, when not in the URL
    store_timeout_s: float = 0.5  # one Redis call; beyond it the turn is served without reuse
    store_retry_s: float = 1.0  # after a failed Redis call, turns skip it this long (no timeout each)
    store_max_connections: int = 16  # to Redis; more concurrent calls queue (redis-py's own pool fails at 100)
    store_prefix: str = "bidikv:"  # Redis key prefix: routers sharing one store use the same one
    # prefill on D (impl.policy.prefill_on_d, impl.router.on_d): the simulator's settings of the same names
    prefill_on_d: str = _d("prefill_on_d")
    prefill_on_d_suffix_tokens: int = _d("prefill_on_d_suffix_tokens")
    prefill_on_d_suffix_ratio: float = _d("prefill_on_d_suffix_ratio")
    prefill_on_d_p_busy_tokens: int = _d("prefill_on_d_p_busy_tokens")
    prefill_on_d_d_pending_tokens: int = _d("prefill_on_d_d_pending_tokens")
    prefill_on_d_lapsed_s: float = _d("prefill_on_d_lapsed_s")
    loop: str = "auto"  # auto (uvloop if installed) | asyncio | uvloop
    log_level: str = "info"

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill", tuple(normalize_base_url(u, "prefill") for u in self.prefill))
        object.__setattr__(self, "decode", tuple(normalize_base_url(u, "decode") for u in self.decode))
        if self.loop not in ("auto", "asyncio", "uvloop"):
            raise ValueError(f"loop must be auto, asyncio or uvloop, got {self.loop!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("max_conversations", "max_store_bytes", "max_body_bytes", "max_conversation_id_len", "health_failures_to_down"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if not 0 <= self.history_lookups <= 64:  # each is a store read on the turn's path
            raise ValueError(f"history_lookups must be in 0..64, got {self.history_lookups}")
        if not (0 < self.trace_sample_rate <= 1):
            raise ValueError(f"trace_sample_rate must be in (0, 1], got {self.trace_sample_rate!r}")
        if self.trace_max_file_bytes < 4096 or self.trace_max_files < 1:
            raise ValueError("trace_max_file_bytes must be >= 4096 and trace_max_files >= 1")
        if not (self.trace_rotate_s > 0 and math.isfinite(self.trace_rotate_s)):
            raise ValueError(f"trace_rotate_s must be a finite number > 0, got {self.trace_rotate_s!r}")
        if self.max_client_connections < 1:
            raise ValueError(f"max_client_connections must be >= 1, got {self.max_client_connections}")
        for name in ("client_header_timeout_s", "client_body_timeout_s", "client_idle_timeout_s", "client_write_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.upstream_max_connections < 0:
            raise ValueError(f"upstream_max_connections must be >= 0, got {self.upstream_max_connections}")
        for name in ("health_interval_s", "health_timeout_s", "connect_timeout_s", "prefill_timeout_s",
                     "decode_idle_timeout_s", "decoder_kv_blocks_ttl", "upstream_keepalive_s", "heartbeat_timeout_s",
                     "heartbeat_retry_s", "store_timeout_s", "store_retry_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        for setting in catalogue.on(ROUTER):  # kind and bounds from the catalogue (D's TTL > 0 above: the router's own)
            try:
                setting.check(getattr(self, setting.name), ROUTER)
            except ValueError as e:
                raise ValueError(f"{setting.name} {e}") from None
        check_store_url(self.store)
        self.prefill_on_d_policy()  # its rules beyond each setting's bounds, naming the settings
        if self.store_max_connections < 1:
            raise ValueError(f"store_max_connections must be >= 1, got {self.store_max_connections}")
        for name in ("notify_wait_s",):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def prefill_on_d_policy(self) -> PrefillOnD:
        """The catalogue's prefill-on-D policy from this router's settings (D's busy fraction and the lapse
        allowance keep their defaults: the router has no flag for them)."""
        return PREFILL_ON_D.build(self.prefill_on_d, {s.name: getattr(self, s.name) for s in catalogue.on(ROUTER)})

    def require_upstreams(self) -> None:
        if not self.prefill:
            raise ValueError("at least one prefill instance is needed (--prefill URL or --prefiller-hosts/--prefiller-ports)")
        if not self.decode:
            raise ValueError("at least one decode instance is needed (--decode URL or --decoder-hosts/--decoder-ports)")


FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(RouterConfig))

# One line of help per field; the CLI turns each into --field-name.
FLAG_HELP: dict[str, str] = {
    "prefill": "prefill instance base URL(s)",
    "decode": "decode instance base URL(s)",
    "host": "address to listen on",
    "port": "port to listen on",
    "api_keys_file": "file of '<tenant> <key>' lines; without keys there is one tenant 'default' and no auth",
    "api_keys_env": "environment variable holding 'tenant=key,tenant=key'",
    "metrics_token_env": "environment variable holding the token /metrics requires (Authorization: Bearer); "
                         "unset: /metrics is open without API keys and refused with them",
    "open_metrics": "serve /metrics without a token even when API keys are configured (its counters move with "
                    "every tenant's traffic: a tenant who can read them learns about the others)",
    "upstream_api_key_env": "environment variable holding the API key sent to vLLM",
    "max_conversations": "conversation store bound (LRU eviction beyond it)",
    "max_store_bytes": "conversation store bound in bytes, as counted per entry (D's block ids are most of it; "
                       "LRU eviction beyond it; 512 MiB fits a 2 GB VM: ~50k conversations of 32k tokens in scattered "
                       "blocks, ~10 KB each packed). "
                       "In-process store only: size Redis with its own maxmemory",
    "max_body_bytes": "largest request body accepted (413 beyond it)",
    "client_header_timeout_s": "a client must send a whole request head within this many seconds of connecting "
                               "(or of the first byte of its next request); then 408 and close. Bounds slowloris",
    "client_body_timeout_s": "a client must send its whole request body within this many seconds of its head; "
                             "then 408 and close (30 s: the 8 MB maximum body needs ~2.2 Mbit/s)",
    "client_idle_timeout_s": "a kept-alive client connection with no new request is closed after this; keep it above "
                             "your clients' own pool idle timeout (httpx 5 s, aiohttp 15 s) so none reuses a closing one",
    "client_write_timeout_s": "a client that takes none of the router's bytes for this long (it stopped reading; "
                              "its socket buffers are full) is disconnected, and D's request with it",
    "max_client_connections": "client connections served at once; one more is answered 503 and closed (the soft "
                              "file-descriptor limit is raised to fit; ~7 KB of RSS per idle connection)",
    "max_conversation_id_len": "longest conversation_id accepted",
    "trace_out": "write the per-turn trace (one JSON line per turn, no text, no ids: impl/trace/format.py) into "
                 "this directory; off by default",
    "trace_salt_env": "environment variable holding the salt of the trace's keyed hashes (unset: a random one per "
                      "process, so files of other replicas or restarts cannot be joined)",
    "trace_sample_rate": "share of conversations traced, all of a conversation's turns or none",
    "trace_max_file_bytes": "a trace file is rotated past this size",
    "trace_rotate_s": "a trace file is rotated after this long",
    "trace_max_files": "trace files kept (the oldest is deleted): the disk bound with --trace-max-file-bytes",
    "history_lookups": "most store keys a request without a conversation id is looked up under, by the history it "
                       "resends (the prefixes ending at an assistant message, most recent first; completions: "
                       "anchors every 256 characters / 64 tokens); 0 = reuse only for requests that name their conversation",
    "max_model_len": "longest context (prompt + max_tokens) a request may ask for, refused with 400 beyond it; "
                     "0: learn each model's max_model_len from the instances' /v1/models",
    "expose_upstream_urls": "debug: name P and D by URL in X-Bidikv-Prefill/X-Bidikv-Decode (default: instance names "
                            "prefill-N/decode-N, so clients do not learn internal addresses)",
    "seed": "seed of placement tie-breaking",
    "health_interval_s": "seconds between health probes of each upstream",
    "health_timeout_s": "timeout of one health probe",
    "health_failures_to_down": "consecutive failed probes before an instance is taken out (refused connections: at once)",
    "connect_timeout_s": "timeout to connect to an upstream",
    "prefill_timeout_s": "timeout of a whole prefill request",
    "decode_idle_timeout_s": "longest silence allowed between bytes of D's response",
    "upstream_max_connections": "connection pool bound per upstream (0: unbounded)",
    "upstream_keepalive_s": "idle upstream connections are closed after this; keep it below vLLM's 5 s keep-alive",
    "notify_url": "URL decode instances use to reach this router's /internal/kv_params",
    "notify_wait_s": "how long to wait for D's notification after its stream ended",
    "heartbeat_timeout_s": "timeout of relaying one client heartbeat to D's heartbeat listener",
    "heartbeat_retry_s": "after D's heartbeat listener timed out or refused, heartbeats and give-back renewals skip "
                         "it for this long (counted as outcome 'skipped'; a renewal then keeps D's published expiry)",
    "rewrite_remote_host": "replace remote_host in kv_transfer_params by the instance's HTTP host",
    "tenant_cache_salt": "with API keys, give each tenant's requests vLLM's cache_salt so tenants never share "
                         "prefix-cache blocks (no cross-tenant cache-timing probe)",
    "store": "conversation store: 'memory' (this process) or redis://[:PASSWORD@]HOST:PORT/DB, rediss://... or "
             "unix://PATH, shared by router replicas and surviving restarts",
    "store_password_env": "environment variable holding the Redis password (when the --store URL has none)",
    "store_timeout_s": "timeout of one conversation-store call; beyond it the turn is served without reuse",
    "store_retry_s": "after a failed conversation-store call, turns skip the store for this long",
    "store_prefix": "key prefix of this router fleet's entries in Redis",
    "store_max_connections": "connections to Redis; calls beyond them wait for one (at most --store-timeout-s)",
    "loop": "event loop implementation",
    "log_level": "logging level",
}
# the catalogue's settings: their help is the catalogue's (one entry each, impl/policy/catalogue.py)
FLAG_HELP.update({s.name: s.help for s in catalogue.on(ROUTER)})
FLAG_HELP.update({s.name: catalogue.selector_help(s.name, ROUTER) for s in catalogue.on(ROUTER) if s.family})
assert set(FLAG_HELP) == FIELD_NAMES, "every config field needs one line of help"


def normalize_base_url(url: str, role: str) -> str:
    """``http://h:p``, ``http://h:p/`` and ``http://h:p/v1`` all mean the instance at ``http://h:p``."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{role} URL must start with http:// or https://, got {url!r}")
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def url_host(host: str) -> str:
    """``host`` as it goes into a URL's authority: an IPv6 literal in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def host_port_urls(hosts: list[str] | None, ports: list[int] | None, role: str) -> list[str]:
    """vLLM's proxy flags (``--prefiller-hosts a b --prefiller-ports 1 2``) as base URLs."""
    if not hosts and not ports:
        return []
    hosts = hosts or ["localhost"]
    ports = ports or []
    if len(hosts) == 1 and len(ports) > 1:
        hosts = hosts * len(ports)  # one host, several ports
    if len(hosts) != len(ports):
        raise ValueError(f"{role}: {len(hosts)} host(s) but {len(ports)} port(s)")
    return [f"http://{h}:{p}" for h, p in zip(hosts, ports)]


def load_toml(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    table = data.get("router", data)
    if not isinstance(table, dict):
        raise ValueError(f"{path}: [router] must be a table")
    _refuse_old_names(table, path)
    unknown = sorted(set(table) - FIELD_NAMES)
    if unknown:
        raise ValueError(f"{path}: unknown setting(s): {', '.join(unknown)}")
    return dict(table)


def _refuse_old_names(table: Mapping[str, Any], where: str) -> None:
    for key in table:
        why = catalogue.old_name_message(key, ROUTER) if key not in FIELD_NAMES else None
        if why is not None:
            raise ValueError(f"{where}: {why}")


def build_config(file_values: Mapping[str, Any] | None = None, overrides: Mapping[str, Any] | None = None) -> RouterConfig:
    """Defaults, then the file's values, then the overrides (flags given on the command line)."""
    values: dict[str, Any] = {}
    for source in (file_values or {}, overrides or {}):
        _refuse_old_names(source, "settings")
        for key, value in source.items():
            if key not in FIELD_NAMES:
                raise ValueError(f"unknown setting {key!r}")
            values[key] = value
    for key in ("prefill", "decode"):
        if key in values:
            value = values[key]
            values[key] = (value,) if isinstance(value, str) else tuple(value)
    return RouterConfig(**values)


def replace(config: RouterConfig, **changes: Any) -> RouterConfig:
    return dataclasses.replace(config, **changes)


__all__ = ["FLAG_HELP", "PLACEMENTS", "RouterConfig", "build_config", "host_port_urls", "load_toml",
           "normalize_base_url", "replace"]
