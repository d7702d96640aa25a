"""From a checked :class:`~impl.deploy.config.DeployConfig` to the exact commands of each step.

A command is an argv (no shell in between when it runs here); over ssh it becomes
``ssh ... DEST 'cd WORKDIR && exec env ...'`` because ssh hands the remote side one string. Printing
is ``shlex.join`` of the same argv, so what ``--dry-run`` shows is what runs, character for character.

Steps, in the order of the walk-through (impl/deploy/README.md):

=========  ====================================================================================
decode     D: vLLM, ``kv_consumer``, NixlConnector from ``impl.connector``   (needs ``--mode``)
prefill    P: vLLM, ``kv_producer``, ``kv_load_failure_policy: "recompute"`` (needs ``--mode``)
router     ``python -m impl.router`` in front of P and D                     (needs ``--mode``)
bench      ``bidikv bench`` through the router, one JSONL per mode           (needs ``--mode``)
report     the ON/OFF table from both JSONLs, then ``bidikv calibrate --from-bench`` on them
=========  ====================================================================================

``--mode off`` is the same deployment with ``bidirectional_kv_xfer: false`` on both servers and the
router's notifications off (no D would post them; waiting for them only delays each turn's record).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any

from impl.connector.two_tier import HostTierConfig, two_tier_kv_transfer_config
from impl.deploy.config import DeployConfig, DeployConfigError, Server
from impl.policy import catalogue

MODES = ("on", "off")
STEPS = ("decode", "prefill", "router", "bench", "report")
STEPS_WITH_MODE = ("decode", "prefill", "router", "bench")
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


@dataclass(frozen=True)
class Command:
    step: str
    title: str  # one human line: what runs where
    argv: tuple[str, ...]

    def shell(self) -> str:
        return shlex.join(self.argv)


def kv_transfer_config(config: DeployConfig, role: str, mode: str) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of P (``role="prefill"``) or D (``"decode"``)."""
    extra = {**config.connector, "bidirectional_kv_xfer": mode == "on", "backends": list(config.transfer.backends)}
    kv: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_connector_module_path": "impl.connector",
        "kv_role": ROLES[role],
        "kv_buffer_device": config.transfer.kv_buffer_device,
        "kv_connector_extra_config": extra,
    }
    if role == "prefill":
        # top-level KVTransferConfig field (vLLM 0.32 config/kv_transfer.py), not an extra-config key:
        # a declined or failed D->P read then recomputes instead of failing the turn
        kv["kv_load_failure_policy"] = "recompute"
    tier = config.host_tier
    if tier is not None:  # with vLLM's host tier: the MultiConnector impl/connector/two_tier.py renders
        server = config.prefill if role == "prefill" else config.decode
        kv = two_tier_kv_transfer_config(kv, HostTierConfig(
            cpu_bytes_to_use=tier.prefill_cpu_bytes_to_use if role == "prefill" else tier.decode_cpu_bytes_to_use,
            p2p_port=tier.prefill_p2p_port if role == "prefill" else tier.decode_p2p_port, p2p_host=server.host,
            eviction_policy=tier.eviction_policy))
    return kv


def server_env(config: DeployConfig, server: Server) -> list[tuple[str, str]]:
    env = list(config.transfer.env)
    env += [("VLLM_NIXL_SIDE_CHANNEL_HOST", server.host),  # vLLM's default is localhost: unreachable from the peer
            ("VLLM_NIXL_SIDE_CHANNEL_PORT", str(server.side_channel_port)),
            ("PYTHONPATH", config.workdir)]  # kv_connector_module_path impl.connector must import
    if config.host_tier is not None:
        # P and D must hash blocks alike for P2P lookups to hit; vLLM seeds from PYTHONHASHSEED when set
        # (v1/core/kv_cache_utils.py), so both get the same one (llm-d's guide does the same)
        env.append(("PYTHONHASHSEED", "0"))
    if server.gpus:
        env.append(("CUDA_VISIBLE_DEVICES", server.gpus))
    return env


def _env_argv(env: list[tuple[str, str]]) -> list[str]:
    return ["env", *(f"{name}={value}" for name, value in env)]


def _where(config: DeployConfig, ssh: str, argv: list[str], *, foreground_server: bool) -> tuple[str, ...]:
    if not ssh:
        return tuple(argv)
    # -tt: a pty on the remote side, so Ctrl-C / a closed connection stops the server there too
    tty = ["-tt"] if foreground_server else []
    remote = f"cd {shlex.quote(config.workdir)} && exec {shlex.join(argv)}"
    return ("ssh", "-o", "BatchMode=yes", *tty, ssh, remote)


def engine_args(config: DeployConfig, role: str, mode: str) -> list[str]:
    """The vLLM engine flags of P or D, the same for the ssh recipe and the Kubernetes manifests."""
    server = config.prefill if role == "prefill" else config.decode
    model = config.model
    argv = ["--model", model.name, "--served-model-name", model.served_name,
            "--tensor-parallel-size", str(model.tensor_parallel_size)]
    if model.max_model_len:
        argv += ["--max-model-len", str(model.max_model_len)]
    if role == "prefill" and not model.prefix_caching_on_prefill:
        argv.append("--no-enable-prefix-caching")
    elif role == "decode":  # vLLM's default, explicit: a turn the router serves on D whole reuses D's cache
        argv.append("--enable-prefix-caching")
    argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(config, role, mode), separators=(",", ":"))]
    return argv + list(server.extra_args)


def require_one_instance(config: DeployConfig) -> None:
    """The ssh recipe runs each server on one instance; a TP group spanning instances is Kubernetes-only."""
    if config.nodes_per_server > 1:
        raise DeployConfigError(config.source, "model.tensor_parallel_size",
                                f"{config.model.tensor_parallel_size} spans {config.nodes_per_server} "
                                f"{config.instance.name}: the ssh recipe starts each server on one instance; render "
                                "Kubernetes manifests instead (bidikv deploy manifests: a LeaderWorkerSet per server)")


def server_command(config: DeployConfig, role: str, mode: str) -> Command:
    require_one_instance(config)
    server = config.prefill if role == "prefill" else config.decode
    argv = _env_argv(server_env(config, server)) + [
        config.python, "-m", "vllm.entrypoints.openai.api_server",
        "--host", server.listen, "--port", str(server.http_port), *engine_args(config, role, mode)]
    name = "P" if role == "prefill" else "D"
    title = (f"{role} ({name}, {ROLES[role]}, bidirectional {mode.upper()}) on {server.host}: HTTP {server.http_port}, "
             f"NIXL side channel {server.side_channel_port}; foreground, Ctrl-C stops it")
    return Command(role, title, _where(config, server.ssh, argv, foreground_server=True))


def router_ttl_s(config: DeployConfig) -> float:
    """The longest D may hold a turn's blocks: the router's upper bound on an entry's life.

    D's notification carries the exact remaining time (impl/router/notify.py) and the router takes the
    smaller of the two, so for a lease or a learned TTL the cap is the right bound."""
    s = config.connector_settings
    return s.values[catalogue.RETENTION[s.retention].longest_hold]


def router_args(config: DeployConfig, mode: str, prefill: list[str], decode: list[str], notify_base: str) -> list[str]:
    """The router's flags in front of the given P and D URLs; D notifies ``notify_base``/internal/kv_params."""
    argv = ["--prefill", *prefill, "--decode", *decode, "--port", str(config.router.port),
            catalogue.setting("decoder_kv_blocks_ttl").flag(), f"{router_ttl_s(config):g}"]
    if mode == "on":
        argv += ["--notify", "--notify-url", f"{notify_base}/internal/kv_params"]
    else:
        argv.append("--no-notify")
    if config.host_tier is not None:  # send P to D's host tier when D no longer holds a turn in HBM
        t = config.host_tier
        for name, value in (("host_tier_capacity_tokens", t.capacity_tokens), ("host_tier_p2p_port", t.decode_p2p_port),
                            ("min_cached_token_delta", t.min_cached_token_delta)):
            argv += [catalogue.setting(name).flag(), str(value)]
    return argv + list(config.router.extra_args)


def router_command(config: DeployConfig, mode: str) -> Command:
    r = config.router
    argv = _env_argv([("PYTHONPATH", config.workdir)]) + [
        config.python, "-m", "impl.router", "--host", r.listen,
        *router_args(config, mode, [config.prefill.url], [config.decode.url], r.url)]
    title = f"router on {r.host}:{r.port} in front of P {config.prefill.url} and D {config.decode.url} (mode {mode})"
    return Command("router", title, _where(config, r.ssh, argv, foreground_server=True))


def bench_commands(config: DeployConfig, mode: str) -> list[Command]:
    b = config.bench
    out = config.results_path(f"{mode}.jsonl")
    mkdir = ["mkdir", "-p", config.results_path("")]
    argv = _env_argv([("PYTHONPATH", config.workdir)]) + [
        config.python, "-m", "impl.cli", "bench", "--url", config.router.url, "--mode", mode,
        "--model", config.model.served_name, "--workload", b.workload,
        "--concurrency", str(b.concurrency), "--seed", str(b.seed), "--out", out]
    if b.workload == "mooncake":
        argv += ["--trace", b.trace]
    else:
        argv += ["--conversations", str(b.conversations)]
    if b.workload_config:
        argv += ["--config", b.workload_config]
    if b.gap_scale:
        argv += ["--gap-scale", f"{b.gap_scale:g}"]
    return [Command("bench", "results directory on the bench host", _where(config, b.ssh, mkdir, foreground_server=False)),
            Command("bench", f"bench, bidirectional {mode.upper()}, through {config.router.url} -> {out}",
                    _where(config, b.ssh, argv, foreground_server=False))]


def report_commands(config: DeployConfig) -> list[Command]:
    on, off = config.results_path("on.jsonl"), config.results_path("off.jsonl")
    both, profile = config.results_path("on_off.jsonl"), config.results_path("profile.json")
    env = _env_argv([("PYTHONPATH", config.workdir)])
    compare = env + [config.python, "-m", "impl.deploy", "compare", on, off, "--merged", both]
    calibrate = env + [config.python, "-m", "impl.cli", "calibrate", "--from-bench", both,
                       "--base-profile", config.base_profile, "--output", profile]
    ssh = config.bench.ssh
    return [Command("report", "the ON/OFF table (TTFT by prompt length), and both runs in one file for the fit",
                    _where(config, ssh, compare, foreground_server=False)),
            Command("report", f"fit a latency profile from both runs -> {profile} (use: bidikv simulate --profile)",
                    _where(config, ssh, calibrate, foreground_server=False))]


def step_commands(config: DeployConfig, step: str, mode: str | None) -> list[Command]:
    if step not in STEPS:
        raise ValueError(f"unknown step {step!r} (steps: {', '.join(STEPS)})")
    if step in STEPS_WITH_MODE and mode not in MODES:
        raise ValueError(f"step {step} needs --mode on or --mode off"
                         + ("" if mode is None else f", got {mode!r}"))
    if step in ("decode", "prefill"):
        return [server_command(config, step, mode)]
    if step == "router":
        return [router_command(config, mode)]
    if step == "bench":
        return bench_commands(config, mode)
    return report_commands(config)


def plan(config: DeployConfig) -> list[tuple[str, list[Command]]]:
    """The whole walk: ON deployment and bench, the same deployment OFF and bench, the report."""
    out = []
    for mode in MODES:
        for step in STEPS_WITH_MODE:
            out.append((f"{step} --mode {mode}", step_commands(config, step, mode)))
    out.append(("report", step_commands(config, "report", None)))
    return out


def format_commands(commands: list[Command]) -> str:
    """Comment line, then the command; commands are single lines (the config rejects newlines)."""
    return "".join(f"# {c.title}\n{c.shell()}\n" for c in commands)


def nul_argv(commands: list[Command]) -> bytes:
    """For the launch scripts: each argument NUL-terminated, each command ended by an empty argument."""
    chunks = []
    for c in commands:
        if any(a == "" or "\0" in a for a in c.argv):
            raise ValueError(f"{c.step}: an argument is empty or holds a NUL byte: {c.argv!r}")
        chunks.append(b"".join(a.encode() + b"\0" for a in c.argv) + b"\0")
    return b"".join(chunks)


__all__ = ["Command", "MODES", "STEPS", "engine_args", "format_commands", "kv_transfer_config", "nul_argv", "plan",
           "require_one_instance", "router_args", "router_command", "router_ttl_s", "server_command", "server_env",
           "step_commands"]
