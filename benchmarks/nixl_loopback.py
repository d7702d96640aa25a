"""NIXL loopback micro-benchmark: the transfer model's terms measured with real NIXL (UCX backend).

    LOOPBACK (UCX over TCP/cma, DRAM), NOT EFA: the numbers show the SHAPE of
    t = per-transfer fixed + per_descriptor x descriptors + bytes / effective_bandwidth
    (calibration.transfer), in particular the per-descriptor term that small blocks hit; they are not
    EFA's constants and must not be fed into a p5en profile.

Two processes on this machine, as vLLM's NixlConnector runs them, both forked from this script after it
has imported nixl once (an import costs 2-30 s on this loaded machine), one pair per agent config:

* a TARGET (the side holding the KV): creates a NIXL agent (UCX backend), allocates one DRAM region
  filled with seeded random bytes, registers it, serves its agent metadata, the region's address and
  its CRC32 over its own TCP side channel (127.0.0.1, an OS-chosen free port unless ``--port``), then
  calls ``get_new_notifs`` every ``--poll-interval`` (vLLM's worker calls it once per engine step);
* an INITIATOR (the side pulling the KV): creates its agent, registers a destination region, fetches
  the target's metadata (``add_remote_agent``), ``make_connection``, prepares one local and one remote
  descriptor list per block size (``prep_xfer_dlist``, one descriptor per block, as vLLM does) and
  times READs of ``count`` blocks at every (block size, count) point, in three modes:

  - ``read``:       ``make_prepped_xfer`` + ``transfer`` + busy-polling ``check_xfer_state``, no
                    notification: the transfer alone, the model's shape (the fit that decides success);
  - ``initialize``: ``initialize_xfer`` (NIXL prepares both lists per transfer) instead of
                    ``make_prepped_xfer``;
  - ``read_notif``: the ``read`` call carrying a notification, exactly as vLLM posts its READs.

Local indices ascend and remote indices descend, so no two descriptors are adjacent on both sides and
NIXL cannot merge them: one descriptor per block is what is timed. Before each mode's timed rounds,
every point is READ once into a sentinel-filled destination and the CRC32 of what landed must equal
the CRC32 of the expected source blocks (regenerated from the seed; the target's CRC32 of its whole
region proves the regeneration matches what it registered); the target must receive exactly one
notification per ``read_notif`` transfer. Timed rounds shuffle the points each round (this machine is
shared, drift spreads over all points); medians are reported. Modes run one after the other, never
interleaved, ``read_notif`` last (see the progress-thread note below).

Measured: (1) one-time setup: ``import nixl`` (once, in the parent), then per side agent creation,
registration, metadata exchange, ``add_remote_agent``, ``make_connection``, descriptor-list prep per
block size, the first transfer (which pays UCX's lazy wire-up); (2) per transfer: make, post, completion polling (their sum
is the transfer time), release; (3) CPU of each process while both sit idle for 0.5 s after the
handshake (nothing of ours running: what NIXL/UCX threads burn) and during the timed phase, and thread
counts; for each agent config:

* ``prog_off``: ``enable_prog_thread=False, num_threads=1`` (keeps the CPU usable; impl/connector/README.md);
* ``prog_on``:  ``enable_prog_thread=True,  num_threads=1``.

Seen here (see calibration/README.md, "NIXL loopback micro-benchmark"): below ~1,000 descriptors a
READ without a notification completes inside ``transfer()`` (the bytes are copied there; UCX picks cma
for them); from 1,024 descriptors on, ``transfer()`` returns early and the rest completes over the
``check_xfer_state`` polls at several us per descriptor. With the progress thread off, a READ that
carries a notification completes only after the TARGET next progresses its UCX worker (here: its next
``get_new_notifs``), so ``read_notif`` takes about the target's poll interval whatever its size
(``--modes read_notif --poll-interval 0.05`` shows it plainly), and a READ posted right after one can
wait as well (hence modes are never interleaved).

Then ``scipy.optimize.least_squares`` (terms >= 0, soft_l1 on relative residuals) fits, per config and
mode, t = fixed + per_descriptor x descriptors + bytes / bandwidth to the medians; for the first mode a
second fit keeps only the points where the line holds on loopback (``REGIME``).

Run:
    .venv/bin/python benchmarks/nixl_loopback.py            # full grid, 4 KiB..1 MiB x 1..4096 blocks, <= 128 MiB
    .venv/bin/python benchmarks/nixl_loopback.py --quick    # small grid, < 30 s
    .venv/bin/python benchmarks/nixl_loopback.py --quick --json
    options: --configs prog_off|prog_on, --modes (first = fitted for the verdict), --reps, --block-sizes KIB..,
    --counts N.., --max-transfer-mib, --poll-interval S (target), --port (target), --log-dir (keep child logs)
Exit status: 0 success; 1 a check failed (bytes, notifications, no positive per-descriptor term or
finite bandwidth in the prog_off read fit); 2 NIXL/UCX could not start.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import pickle
import random
import resource
import select
import signal
import socket
import statistics
import struct
import multiprocessing
import sys
import tempfile
import time
import zlib
from pathlib import Path

LABEL = "loopback (UCX over TCP/cma, DRAM), not EFA"
SHAPE_NOTE = ("these numbers show the transfer model's SHAPE (the per-descriptor term vLLM users hit with "
              "small blocks), not EFA's constants")
KIB = 1024
MIB = 1024 * 1024
SENTINEL = 0xA5
EXIT_CHECK_FAILED = 1
EXIT_NIXL_UNAVAILABLE = 2

CONFIGS = {
    "prog_off": {"enable_prog_thread": False, "num_threads": 1},
    "prog_on": {"enable_prog_thread": True, "num_threads": 1},
}

FULL_GRID = {"block_sizes": [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB],
             "counts": [1, 4, 16, 64, 256, 1024, 4096], "reps": 15, "max_transfer_bytes": 128 * MIB}
MODES = {
    "read": "make_prepped_xfer + transfer + poll, no notification (the transfer alone: the model's shape)",
    "read_notif": "the same READ carrying a notification, as vLLM's NixlConnector posts them",
    "initialize": "initialize_xfer (NIXL prepares both lists per transfer) + transfer + poll, no notification",
}
PRIMARY_CONFIG = "prog_off"
# Where the line holds on loopback (measured here): below ~1,000 descriptors per transfer (at 1,024 and
# more, transfer() returns early and the rest completes over check_xfer_state polls at several us per
# descriptor) and up to a few MiB per transfer (beyond, the copy runs at DRAM rather than cache speed).
# A second fit over these points only is printed beside the all-points fit, which decides success.
REGIME = {"max_blocks": 512, "max_bytes": 4 * MIB}

QUICK_GRID = {"block_sizes": [4 * KIB, 64 * KIB, 1 * MIB], "counts": [1, 16, 128, 512], "reps": 7,
              "max_transfer_bytes": 16 * MIB}


class NixlUnavailable(RuntimeError):
    """NIXL or its UCX backend could not start."""


class CheckFailed(RuntimeError):
    """Bytes, notifications or a transfer state were wrong."""


# --- small helpers ----------------------------------------------------------------------------------

def _fmt_bytes(n: float) -> str:
    if n >= MIB and n % MIB == 0:
        return f"{int(n // MIB)} MiB"
    if n >= KIB and n % KIB == 0:
        return f"{int(n // KIB)} KiB"
    return f"{n:.0f} B"


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


def _send(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj)
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("side channel closed by peer")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket):
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    return pickle.loads(_recv_exact(sock, n))


def _region(size: int):
    """A page-aligned anonymous DRAM region and a uint8 numpy view of it."""
    import numpy as np
    mm = mmap.mmap(-1, size)
    arr = np.frombuffer(mm, dtype=np.uint8)
    return mm, arr, int(arr.ctypes.data)


def _source_bytes(seed: int, size: int) -> bytes:
    import numpy as np
    return np.random.default_rng(seed).bytes(size)


def _make_agent(name: str, config_name: str):
    """Import nixl and create an agent with the UCX backend; NixlUnavailable if that cannot happen."""
    timings = {}
    t = time.perf_counter()
    try:
        from nixl import nixl_agent, nixl_agent_config
    except Exception as exc:  # ImportError, or a backend library failing to load
        raise NixlUnavailable(f"cannot import nixl: {type(exc).__name__}: {exc}") from exc
    timings["import_nixl_s"] = time.perf_counter() - t
    cfg = CONFIGS[config_name]
    t = time.perf_counter()
    try:
        agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=cfg["enable_prog_thread"],
                                                   num_threads=cfg["num_threads"], backends=["UCX"]))
    except Exception as exc:
        raise NixlUnavailable(f"cannot create a NIXL agent with the UCX backend: {type(exc).__name__}: {exc} "
                              f"(UCX_TLS={os.environ.get('UCX_TLS', '<unset>')}; if set it must include tcp)") from exc
    timings["agent_create_s"] = time.perf_counter() - t
    if "UCX" not in agent.backends:
        raise NixlUnavailable(f"NIXL started without its UCX backend (plugins found: {agent.get_plugin_list()}; "
                              f"UCX_TLS={os.environ.get('UCX_TLS', '<unset>')})")
    return agent, timings


def _register(agent, addr: int, size: int):
    import numpy as np
    t = time.perf_counter()
    descs = agent.register_memory(np.array([[addr, size, 0]], dtype=np.uint64), "DRAM")
    if descs is None:
        raise NixlUnavailable("register_memory returned no descriptors")
    return descs, time.perf_counter() - t


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _child_main(role_fn, out: str) -> int:
    try:
        result = role_fn()
        _write_json(out, result)
        return 0
    except NixlUnavailable as exc:
        _write_json(out, {"ok": False, "error": str(exc), "nixl_unavailable": True})
        return EXIT_NIXL_UNAVAILABLE
    except Exception as exc:  # reported by the parent with the child's stderr
        _write_json(out, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return EXIT_CHECK_FAILED


# --- the target -------------------------------------------------------------------------------------

def target(args) -> dict:
    setup = {}
    t_all = time.perf_counter()
    agent, timings = _make_agent(f"bidikv-loopback-target-{os.getpid()}", args.config)
    setup.update(timings)
    t = time.perf_counter()
    mm, arr, addr = _region(args.region_bytes)
    arr[:] = memoryview(_source_bytes(args.seed, args.region_bytes))
    crc = zlib.crc32(arr)
    setup["alloc_fill_s"] = time.perf_counter() - t
    reg, setup["register_s"] = _register(agent, addr, args.region_bytes)
    t = time.perf_counter()
    metadata = agent.get_agent_metadata()
    setup["get_metadata_s"] = time.perf_counter() - t
    setup["metadata_bytes"] = len(metadata)
    setup["total_before_listen_s"] = time.perf_counter() - t_all
    threads = _threads()

    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", args.port))
    server.listen(1)
    port = server.getsockname()[1]
    _write_json(args.ready_file, {"port": port})
    server.settimeout(args.timeout)
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t = time.perf_counter()
    _send(conn, {"metadata": metadata, "agent_name": agent.name, "addr": addr, "size": args.region_bytes,
                 "crc32": crc, "seed": args.seed})
    setup["send_metadata_s"] = time.perf_counter() - t

    notifs = 0
    cpu = {}
    serve_cpu0, serve_wall0 = _cpu_s(), time.perf_counter()
    # serve until the initiator says "done" (or closes the side channel: _recv raises); the parent
    # bounds the whole run and this process dies with it
    while True:
        ready, _, _ = select.select([conn], [], [], args.poll_interval)
        for msgs in agent.get_new_notifs().values():
            notifs += len(msgs)
        if not ready:
            continue
        msg = _recv(conn)
        if msg["cmd"] == "idle_probe":
            # nothing of ours runs: whatever CPU this process burns now is NIXL/UCX's own threads
            c0, w0 = _cpu_s(), time.perf_counter()
            time.sleep(msg["seconds"])
            cpu["idle_cpu_frac"] = (_cpu_s() - c0) / (time.perf_counter() - w0)
            cpu["threads_after_handshake"] = _threads()
            _send(conn, {"idle_cpu_frac": cpu["idle_cpu_frac"]})
            serve_cpu0, serve_wall0 = _cpu_s(), time.perf_counter()
        elif msg["cmd"] == "done":
            # a last drain: notifications can trail the initiator's DONE
            drain_until = time.monotonic() + 5.0
            while notifs < msg["expected_notifs"] and time.monotonic() < drain_until:
                for msgs in agent.get_new_notifs().values():
                    notifs += len(msgs)
                time.sleep(0.001)
            cpu["serve_cpu_frac"] = (_cpu_s() - serve_cpu0) / (time.perf_counter() - serve_wall0)
            _send(conn, {"notifs": notifs})
            break
    conn.close()
    server.close()
    cpu["threads_after_agent"] = threads
    t = time.perf_counter()
    agent.deregister_memory(reg)
    teardown = time.perf_counter() - t
    return {"ok": True, "role": "target", "config": args.config, "setup": setup, "cpu": cpu, "notifs": notifs,
            "deregister_s": teardown, "poll_interval_s": args.poll_interval}


# --- the initiator ----------------------------------------------------------------------------------

def _points(grid: dict) -> list[tuple[int, int]]:
    return [(bs, n) for bs in grid["block_sizes"] for n in grid["counts"] if bs * n <= grid["max_transfer_bytes"]]


def _wait_port(ready_file: str, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while not os.path.exists(ready_file):
        if time.monotonic() > deadline:
            raise CheckFailed(f"initiator: the target published no side-channel port within {timeout} s")
        time.sleep(0.01)
    with open(ready_file) as f:
        return json.load(f)["port"]


def initiator(args) -> dict:
    import numpy as np

    grid = json.loads(args.grid)
    points = _points(grid)
    modes = args.modes or list(MODES)
    setup = {}
    agent, timings = _make_agent(f"bidikv-loopback-initiator-{os.getpid()}", args.config)
    setup.update(timings)
    threads_after_agent = _threads()
    t = time.perf_counter()
    mm, dest, addr = _region(args.region_bytes)
    dest[:] = SENTINEL
    setup["alloc_fill_s"] = time.perf_counter() - t
    reg, setup["register_s"] = _register(agent, addr, args.region_bytes)

    port = _wait_port(args.ready_file, args.timeout)
    t = time.perf_counter()
    sock = socket.create_connection(("127.0.0.1", port), timeout=args.timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    info = _recv(sock)
    setup["metadata_exchange_s"] = time.perf_counter() - t
    t = time.perf_counter()
    remote = agent.add_remote_agent(info["metadata"])
    setup["add_remote_agent_s"] = time.perf_counter() - t
    if isinstance(remote, bytes):
        remote = remote.decode()
    t = time.perf_counter()
    agent.make_connection(remote)
    setup["make_connection_s"] = time.perf_counter() - t

    # both sides idle at once, nothing of ours polling: the CPU each burns is NIXL/UCX's own
    idle_s = 0.5
    c0, w0 = _cpu_s(), time.perf_counter()
    _send(sock, {"cmd": "idle_probe", "seconds": idle_s})
    time.sleep(idle_s)
    initiator_idle = (_cpu_s() - c0) / (time.perf_counter() - w0)
    target_idle = _recv(sock)["idle_cpu_frac"]

    # one local and one remote descriptor list per block size, one descriptor per block (vLLM's layout)
    size = args.region_bytes
    prepped, rows_by_bs, dlist_prep = {}, {}, []
    for bs in grid["block_sizes"]:
        slots = size // bs
        offsets = np.arange(slots, dtype=np.uint64) * np.uint64(bs)
        local = np.stack([addr + offsets, np.full(slots, bs, np.uint64), np.zeros(slots, np.uint64)], axis=1)
        rem = np.stack([info["addr"] + offsets, np.full(slots, bs, np.uint64), np.zeros(slots, np.uint64)], axis=1)
        t = time.perf_counter()
        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
        t_local = time.perf_counter() - t
        t = time.perf_counter()
        rh = agent.prep_xfer_dlist(remote, rem, "DRAM")
        t_remote = time.perf_counter() - t
        prepped[bs] = (lh, rh, slots)
        rows_by_bs[bs] = (local, rem)
        dlist_prep.append({"block_bytes": bs, "descriptors": int(slots), "local_s": t_local, "remote_s": t_remote})
    setup["dlist_prep"] = dlist_prep

    # the expected source, regenerated from the seed and checked against the target's own CRC32
    src = np.frombuffer(_source_bytes(info["seed"], size), dtype=np.uint8)
    if zlib.crc32(src) != info["crc32"]:
        raise CheckFailed("regenerated source differs from the target's region (CRC32 mismatch)")

    # local slots ascend, remote slots descend: no two descriptors are adjacent on both sides (no merging)
    indices, xfer_descs = {}, {}
    for bs, n in points:
        slots = prepped[bs][2]
        lidx, ridx = np.arange(n, dtype=np.int32), np.arange(slots - 1, slots - 1 - n, -1, dtype=np.int32)
        indices[(bs, n)] = (lidx, ridx)
        local, rem = rows_by_bs[bs]
        xfer_descs[(bs, n)] = (agent.get_xfer_descs(np.ascontiguousarray(local[lidx]), "DRAM"),
                               agent.get_xfer_descs(np.ascontiguousarray(rem[ridx]), "DRAM"))

    counts = {"transfers": 0, "notifs_sent": 0}
    deadline_s = args.timeout

    def one(mode: str, bs: int, n: int) -> dict:
        notif = b""
        if mode == "read_notif":
            notif = b"bidikv-%d" % counts["transfers"]
        t0 = time.perf_counter_ns()
        if mode == "initialize":
            ld, rd = xfer_descs[(bs, n)]
            h = agent.initialize_xfer("READ", ld, rd, remote, notif)
        else:
            lh, rh, _ = prepped[bs]
            lidx, ridx = indices[(bs, n)]
            h = agent.make_prepped_xfer("READ", lh, lidx, rh, ridx, notif)
        t1 = time.perf_counter_ns()
        state = agent.transfer(h)
        t2 = time.perf_counter_ns()
        polls = 0
        limit = t2 + int(deadline_s * 1e9)
        while state == "PROC":
            state = agent.check_xfer_state(h)
            polls += 1
            if polls % 1024 == 0 and time.perf_counter_ns() > limit:
                raise CheckFailed(f"{mode} transfer {n} x {_fmt_bytes(bs)} still in progress after {deadline_s} s")
        t3 = time.perf_counter_ns()
        if state != "DONE":
            raise CheckFailed(f"{mode} transfer {n} x {_fmt_bytes(bs)} ended in state {state}")
        agent.release_xfer_handle(h)
        t4 = time.perf_counter_ns()
        counts["transfers"] += 1
        counts["notifs_sent"] += bool(notif)
        return {"make_s": (t1 - t0) / 1e9, "post_s": (t2 - t1) / 1e9, "wait_s": (t3 - t2) / 1e9,
                "total_s": (t3 - t0) / 1e9, "release_s": (t4 - t3) / 1e9, "polls": polls}

    # the very first transfer pays the lazy UCX wire-up (make_connection only starts it)
    bs0, n0 = min(points, key=lambda p: (p[0] * p[1], p[1]))
    setup["first_transfer"] = {"mode": "read", "block_bytes": bs0, "blocks": n0, **one("read", bs0, n0)}

    # Mode by mode (never interleaved: with the progress thread off, a READ posted after one that carried
    # a notification can wait for the target too), read_notif last. Per mode: a warm-up + byte check of
    # every point (sentinel, READ, CRC32 of what landed), then timed rounds, points shuffled each round.
    verified = 0
    src_blocks = {bs: src.reshape(-1, bs) for bs in grid["block_sizes"]}
    rng = random.Random(args.seed)
    samples = {}
    timed_wall, timed_cpu = 0.0, 0.0
    for mode in sorted(modes, key=lambda m: m == "read_notif"):
        for bs, n in points:
            nbytes = bs * n
            dest[:nbytes] = SENTINEL
            one(mode, bs, n)
            got_crc = zlib.crc32(dest[:nbytes])
            want_crc = zlib.crc32(src_blocks[bs][indices[(bs, n)][1]])
            if got_crc != want_crc:
                raise CheckFailed(f"bytes differ after {mode} READ of {n} x {_fmt_bytes(bs)}: crc32 {got_crc:#010x} "
                                  f"!= expected {want_crc:#010x}")
            verified += 1
        order = list(points)
        for p in order:
            samples[(mode, *p)] = []
        c0, w0 = _cpu_s(), time.perf_counter()
        for _ in range(grid["reps"]):
            rng.shuffle(order)
            for p in order:
                samples[(mode, *p)].append(one(mode, *p))
        timed_wall += time.perf_counter() - w0
        timed_cpu += _cpu_s() - c0
    initiator_busy = timed_cpu / timed_wall

    _send(sock, {"cmd": "done", "expected_notifs": counts["notifs_sent"]})
    notifs = _recv(sock)["notifs"]
    sock.close()
    if notifs != counts["notifs_sent"]:
        raise CheckFailed(f"target received {notifs} notifications, {counts['notifs_sent']} were sent")

    results = {}
    for mode in modes:
        rows = []
        for bs, n in points:
            s = samples[(mode, bs, n)]
            med = {k: statistics.median(x[k] for x in s) for k in ("make_s", "post_s", "wait_s", "total_s", "release_s")}
            totals = sorted(x["total_s"] for x in s)
            rows.append({"block_bytes": bs, "blocks": n, "bytes": bs * n, "reps": len(s),
                         **{f"median_{k}": v for k, v in med.items()},
                         "min_total_s": totals[0], "max_total_s": totals[-1],
                         "median_polls": statistics.median(x["polls"] for x in s),
                         "samples_us": [[round(x[k] * 1e6, 1) for k in ("make_s", "post_s", "wait_s")] for x in s]})
        results[mode] = rows

    for lh, rh, _ in prepped.values():
        agent.release_dlist_handle(lh)
        agent.release_dlist_handle(rh)
    agent.remove_remote_agent(remote)
    agent.deregister_memory(reg)
    return {"ok": True, "role": "initiator", "config": args.config, "setup": setup, "modes": results,
            "verified_transfers": verified, "transfers": counts["transfers"], "notifs_sent": counts["notifs_sent"],
            "notifs_at_target": notifs, "timed_wall_s": timed_wall,
            "cpu": {"idle_cpu_frac": initiator_idle, "target_idle_cpu_frac": target_idle,
                    "timed_cpu_frac": initiator_busy, "threads_after_agent": threads_after_agent}}


# --- the parent: run both sides per config, fit, report ----------------------------------------------

def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class _Child:
    """One side, forked from the parent (which has imported nixl once: the sides do not import it again, an
    import takes 2-30 s on this loaded machine), its stdout/stderr (NIXL/UCX logs) in a file. It dies with
    the parent (PR_SET_PDEATHSIG)."""

    def __init__(self, argv: list[str], log_path: Path):
        self.proc = multiprocessing.get_context("fork").Process(target=_child_entry, args=(argv, str(log_path)))
        self.proc.start()

    def poll(self) -> int | None:
        return self.proc.exitcode

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()

    def wait(self) -> None:
        self.proc.join()


def _child_entry(argv: list[str], log_path: str) -> None:
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.exit(main(argv))


def run_pair(config: str, grid: dict, region_bytes: int, args, workdir: Path) -> dict:
    """Fork a target and an initiator, wait for both, collect their JSON."""
    files = {k: workdir / f"{config}.{k}" for k in ("ready", "target.json", "initiator.json", "target.log", "initiator.log")}
    common = ["--config", config, "--region-bytes", str(region_bytes), "--seed", str(args.seed),
              "--timeout", str(args.timeout), "--ready-file", str(files["ready"])]
    argv = {"target": ["--role", "target", *common, "--port", str(args.port),
                       "--poll-interval", str(args.poll_interval), "--out", str(files["target.json"])],
            "initiator": ["--role", "initiator", *common, "--grid", json.dumps(grid),
                          *(["--modes", *args.modes] if args.modes else []),
                          "--out", str(files["initiator.json"])]}
    procs: dict[str, _Child] = {}
    t0 = time.perf_counter()
    try:
        for role in ("target", "initiator"):
            procs[role] = _Child(argv[role], files[f"{role}.log"])
        limit_s = (3 if args.quick else 10) * args.timeout  # each side also times out on its own waits
        deadline = time.monotonic() + limit_s
        # whichever side fails first is the one to report
        while any(p.poll() is None for p in procs.values()):
            for role, p in procs.items():
                if p.poll() not in (None, 0):
                    return _failed(config, role, p, files)
            if time.monotonic() > deadline:
                role = "initiator" if procs["initiator"].poll() is None else "target"
                return _failed(config, role, procs[role], files, f"no result within {limit_s:.0f} s")
            time.sleep(0.02)
        for role, p in procs.items():
            if p.returncode != 0:
                return _failed(config, role, p, files)
        return {"config": config, "agent_config": CONFIGS[config], "ok": True, "wall_s": time.perf_counter() - t0,
                "target": json.loads(files["target.json"].read_text()),
                "initiator": json.loads(files["initiator.json"].read_text())}
    finally:
        for p in procs.values():  # only the two children this function started
            if p.poll() is None:
                p.kill()
                p.wait()


def _failed(config: str, role: str, proc: _Child, files: dict, why: str = "") -> dict:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    detail = {}
    out = files[f"{role}.json"]
    if out.exists():
        detail = json.loads(out.read_text())
    unavailable = bool(detail.get("nixl_unavailable")) or proc.returncode == EXIT_NIXL_UNAVAILABLE
    msg = why or detail.get("error") or f"exited with status {proc.returncode}"
    return {"config": config, "agent_config": CONFIGS[config], "ok": False, "nixl_unavailable": unavailable,
            "failed_role": role, "error": msg, "log_tail": _tail(files[f"{role}.log"])}


def fit(points: list[dict]) -> dict:
    """t = fixed + per_descriptor x descriptors + bytes / bandwidth, all terms >= 0, relative residuals
    (pred / measured - 1) on the medians, robust soft_l1 loss."""
    import numpy as np
    from scipy.optimize import least_squares, lsq_linear

    n = np.array([p["blocks"] for p in points], float)
    b = np.array([p["bytes"] for p in points], float)
    t = np.array([p["median_total_s"] for p in points], float)
    # relative residuals: the times span four orders of magnitude and every point should count alike
    scale = np.array([1e-5, 1e-6, 1e-10])  # s, s/descriptor, s/byte: conditions the problem
    A = np.stack([np.ones_like(n), n, b], axis=1) / t[:, None]
    x0 = lsq_linear(A * scale, np.ones_like(t), bounds=(0, np.inf)).x * scale
    x0 = np.maximum(x0, scale * 1e-3)  # strictly inside the bounds

    def residuals(x):
        return (x[0] + x[1] * n + x[2] * b) / t - 1.0

    # soft_l1: a point more than ~20 % off the line (a noisy neighbour on this shared machine) weighs less
    res = least_squares(residuals, x0, bounds=(0, np.inf), x_scale=scale, method="trf", loss="soft_l1", f_scale=0.2)
    fixed, per_desc, s_per_byte = (float(v) for v in res.x)
    pred = fixed + per_desc * n + s_per_byte * b
    rel = pred / t - 1.0
    bw = 1.0 / s_per_byte if s_per_byte > 0 else float("inf")
    return {
        "model": "t = fixed + per_descriptor x descriptors + bytes / bandwidth",
        "fixed_per_transfer_s": fixed, "per_descriptor_s": per_desc, "bandwidth_bytes_per_s": bw,
        "crossover_block_bytes": per_desc * bw if bw < float("inf") else float("inf"),
        "loss": "soft_l1 on relative residuals, f_scale 0.2", "success": bool(res.success), "cost": float(res.cost),
        "rms_rel_residual": float(np.sqrt(np.mean(rel ** 2))), "max_abs_rel_residual": float(np.max(np.abs(rel))),
        "residuals": [{"block_bytes": p["block_bytes"], "blocks": p["blocks"], "measured_s": float(tm),
                       "predicted_s": float(pm), "rel": float(r)} for p, tm, pm, r in zip(points, t, pred, rel)],
    }


def _primary(result: dict) -> dict | None:
    ok = [r for r in result["runs"] if r["ok"]]
    for r in ok:
        if r["config"] == PRIMARY_CONFIG:
            return r
    return ok[0] if ok else None


def _print_report(result: dict) -> None:
    ms = 1e3
    print(f"NIXL loopback micro-benchmark -- {LABEL}")
    print(f"  {SHAPE_NOTE}.")
    print(f"  nixl {result['nixl_version']}, UCX_TLS={result['ucx_tls']}; load average {result['loadavg_start'][0]:.2f} "
          f"at start, {result['loadavg_end'][0]:.2f} at end (shared 2-core machine: medians, not minima)")
    print("  modes: " + "; ".join(f"{m} = {d}" for m, d in result["modes"].items()))
    print(f"  import nixl: {result['import_nixl_s'] * 1e3:.0f} ms, once, in the parent; both sides of every config are "
          "forked from it")
    for run in result["runs"]:
        print(f"\n=== config {run['config']}: {run['agent_config']}  [{LABEL}] ===")
        if not run["ok"]:
            print(f"  FAILED ({run['failed_role']}): {run['error']}")
            continue
        ini, tgt = run["initiator"], run["target"]
        s, ts = ini["setup"], tgt["setup"]
        print(f"  one-time setup, initiator: agent {s['agent_create_s'] * ms:.1f} ms, "
              f"register {_fmt_bytes(result['region_bytes'])} {s['register_s'] * ms:.2f} ms, metadata exchange "
              f"{s['metadata_exchange_s'] * ms:.2f} ms, add_remote_agent {s['add_remote_agent_s'] * ms:.2f} ms, "
              f"make_connection {s['make_connection_s'] * ms:.3f} ms")
        print(f"  one-time setup, target:    agent {ts['agent_create_s'] * ms:.1f} ms, "
              f"register {ts['register_s'] * ms:.2f} ms, get_agent_metadata {ts['get_metadata_s'] * ms:.3f} ms "
              f"({ts['metadata_bytes']} B)")
        for d in s["dlist_prep"]:
            per = (d["local_s"] + d["remote_s"]) / (2 * d["descriptors"])
            print(f"  descriptor-list prep, {_fmt_bytes(d['block_bytes']):>7} blocks: {d['descriptors']:6d} descriptors, local "
                  f"{d['local_s'] * ms:.2f} ms + remote {d['remote_s'] * ms:.2f} ms ({per * 1e9:.0f} ns/descriptor)")
        f = s["first_transfer"]
        print(f"  first transfer (pays the lazy UCX wire-up): {f['blocks']} x {_fmt_bytes(f['block_bytes'])} in "
              f"{f['total_s'] * ms:.2f} ms")
        modes = list(ini["modes"])
        main, others = modes[0], modes[1:]
        rows = ini["modes"]
        print(f"  per transfer, median of {rows[main][0]['reps']} ({main}: make = make_prepped_xfer or initialize_xfer, "
              f"post = transfer(), wait = polling check_xfer_state; other modes: total and wait):")
        print(f"  {'block':>7} {'blocks':>6} {'bytes':>7} | {'make us':>7} {'post us':>8} {'wait us':>7} {main + ' us':>8} "
              f"{'GiB/s':>6} {'us/desc':>7}" + "".join(f" | {m + ' us':>13} {'wait us':>8}" for m in others))
        for i, r in enumerate(rows[main]):
            gib = r["bytes"] / r["median_total_s"] / 2 ** 30
            print(f"  {_fmt_bytes(r['block_bytes']):>7} {r['blocks']:6d} {_fmt_bytes(r['bytes']):>7} | "
                  f"{r['median_make_s'] * 1e6:7.1f} {r['median_post_s'] * 1e6:8.1f} {r['median_wait_s'] * 1e6:7.1f} "
                  f"{r['median_total_s'] * 1e6:8.1f} {gib:6.2f} {r['median_total_s'] * 1e6 / r['blocks']:7.2f}"
                  + "".join(f" | {rows[m][i]['median_total_s'] * 1e6:13.1f} {rows[m][i]['median_wait_s'] * 1e6:8.1f}"
                            for m in others))
        print(f"  bytes verified by CRC32 after {ini['verified_transfers']} READs (every mode and point); notifications "
              f"at target {ini['notifs_at_target']} / {ini['notifs_sent']} sent; {ini['transfers']} transfers in all")
        c = ini["cpu"]
        print(f"  CPU, fraction of one core: both idle 0.5 s after the handshake: initiator {c['idle_cpu_frac']:.2f}, "
              f"target {c['target_idle_cpu_frac']:.2f}; timed phase: initiator {c['timed_cpu_frac']:.2f} (it busy-polls "
              f"check_xfer_state), target {tgt['cpu']['serve_cpu_frac']:.2f} (incl. its get_new_notifs every "
              f"{tgt['poll_interval_s'] * 1e3:g} ms); threads: initiator {c['threads_after_agent']}, target "
              f"{tgt['cpu']['threads_after_agent']}")
        print(f"  fit per mode (scipy least_squares, terms >= 0, soft_l1 on relative residuals) [{LABEL}]:")
        print(f"    {'mode':<11} {'fixed us/xfer':>13} {'ns/descriptor':>13} {'GiB/s':>7} {'crossover':>10} "
              f"{'rms resid':>9} {'max resid':>9}")
        for m in modes:
            fr = run["fits"][m]
            cross = fr["crossover_block_bytes"]
            print(f"    {m:<11} {fr['fixed_per_transfer_s'] * 1e6:13.2f} {fr['per_descriptor_s'] * 1e9:13.1f} "
                  f"{fr['bandwidth_bytes_per_s'] / 2 ** 30:7.2f} {(_fmt_bytes(round(cross)) if cross < 1e18 else 'inf'):>10} "
                  f"{fr['rms_rel_residual'] * 100:8.1f}% {fr['max_abs_rel_residual'] * 100:8.1f}%")
        for m, fr in run["fits_linear_regime"].items():
            if m != main:
                continue
            print(f"    {m + '*':<11} {fr['fixed_per_transfer_s'] * 1e6:13.2f} {fr['per_descriptor_s'] * 1e9:13.1f} "
                  f"{fr['bandwidth_bytes_per_s'] / 2 ** 30:7.2f} {_fmt_bytes(round(fr['crossover_block_bytes'])) if fr['crossover_block_bytes'] < 1e18 else 'inf':>10} "
                  f"{fr['rms_rel_residual'] * 100:8.1f}% {fr['max_abs_rel_residual'] * 100:8.1f}%   * only the {fr['points']} "
                  f"points with <= {fr['criteria']['max_blocks']} blocks and <= {_fmt_bytes(fr['criteria']['max_bytes'])}")
        fr = run["fits"][main]
        print(f"  {main} fit: fixed {fr['fixed_per_transfer_s'] * 1e6:.2f} us per transfer + {fr['per_descriptor_s'] * 1e9:.0f} ns "
              f"per descriptor + bytes / {fr['bandwidth_bytes_per_s'] / 2 ** 30:.2f} GiB/s "
              f"({fr['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s); crossover block size (per-descriptor cost = its "
              f"wire time) {_fmt_bytes(round(fr['crossover_block_bytes'])) if fr['crossover_block_bytes'] < 1e18 else 'inf'}; "
              "residuals:")
        print(f"    {'block':>7} {'blocks':>6} {'measured us':>12} {'model us':>10} {'resid':>8}")
        for r in fr["residuals"]:
            print(f"    {_fmt_bytes(r['block_bytes']):>7} {r['blocks']:6d} {r['measured_s'] * 1e6:12.1f} "
                  f"{r['predicted_s'] * 1e6:10.1f} {r['rel'] * 100:7.1f}%")
    print(f"\n{'OK' if result['ok'] else 'FAILED'}: {result['summary']}  [{LABEL}]")


def _nixl_version() -> str:
    try:
        from importlib.metadata import version
        return version("nixl")
    except Exception:
        return "unknown"


def parent(args) -> int:
    grid = dict(QUICK_GRID if args.quick else FULL_GRID)
    if args.reps:
        grid["reps"] = args.reps
    if args.block_sizes:
        grid["block_sizes"] = [int(b * KIB) for b in args.block_sizes]
    if args.counts:
        grid["counts"] = args.counts
    if args.max_transfer_mib:
        grid["max_transfer_bytes"] = int(args.max_transfer_mib * MIB)
    points = _points(grid)
    if len({n for _, n in points}) < 2 or len({bs for bs, _ in points}) < 2:
        print("error: the grid needs at least two block sizes and two block counts to fit three terms", file=sys.stderr)
        return EXIT_CHECK_FAILED
    region_bytes = max(bs * n for bs, n in points)
    result = {"label": LABEL, "note": SHAPE_NOTE, "quick": args.quick, "grid": grid,
              "modes": {m: MODES[m] for m in (args.modes or MODES)},
              "region_bytes": region_bytes, "nixl_version": _nixl_version(), "ucx_tls": os.environ.get("UCX_TLS", "<unset>"),
              "primary": {"config": PRIMARY_CONFIG, "mode": (args.modes or list(MODES))[0]}, "loadavg_start": list(os.getloadavg()), "runs": []}
    t0 = time.perf_counter()
    try:  # once, here: both sides are forked from this process
        import nixl
        result["import_nixl_s"] = time.perf_counter() - t0
        del nixl
    except Exception as exc:
        result.update(ok=False, summary=f"NIXL/UCX cannot start: cannot import nixl: {type(exc).__name__}: {exc}",
                      wall_s=time.perf_counter() - t0, loadavg_end=list(os.getloadavg()))
        print(json.dumps(result, indent=1) if args.json else f"FAILED: {result['summary']}  [{LABEL}]")
        print(f"error: NIXL/UCX cannot start: cannot import nixl in {sys.executable}: {exc}", file=sys.stderr)
        return EXIT_NIXL_UNAVAILABLE
    with tempfile.TemporaryDirectory(prefix="nixl_loopback_") as tmp:
        logdir = Path(args.log_dir) if args.log_dir else Path(tmp)
        logdir.mkdir(parents=True, exist_ok=True)
        for cfg in args.configs or list(CONFIGS):
            for stale in logdir.glob(f"{cfg}.*"):
                stale.unlink()
            run = run_pair(cfg, grid, region_bytes, args, logdir)
            if run["ok"]:
                run["fits"] = {m: fit(rows) for m, rows in run["initiator"]["modes"].items()}
                run["fits_linear_regime"] = {}
                for m, rows in run["initiator"]["modes"].items():
                    sub = [r for r in rows if r["blocks"] <= REGIME["max_blocks"] and r["bytes"] <= REGIME["max_bytes"]]
                    if len({r["blocks"] for r in sub}) >= 2 and len({r["block_bytes"] for r in sub}) >= 2:
                        run["fits_linear_regime"][m] = {**fit(sub), "points": len(sub), "criteria": REGIME}
            result["runs"].append(run)
            if not run["ok"] and run.get("nixl_unavailable"):
                break  # the next config would fail the same way
    result["wall_s"] = time.perf_counter() - t0
    result["loadavg_end"] = list(os.getloadavg())

    failures = [r for r in result["runs"] if not r["ok"]]
    primary = _primary(result)
    primary_mode = (args.modes or list(MODES))[0]
    pf = primary["fits"][primary_mode] if primary else None
    fit_ok = bool(pf) and pf["per_descriptor_s"] > 0 and 0 < pf["bandwidth_bytes_per_s"] < float("inf")
    result["ok"] = not failures and fit_ok
    status = 0
    if failures and any(r.get("nixl_unavailable") for r in failures):
        status = EXIT_NIXL_UNAVAILABLE
        result["summary"] = "NIXL/UCX cannot start: " + "; ".join(f"{r['config']} {r['failed_role']}: {r['error']}" for r in failures)
    elif failures:
        status = EXIT_CHECK_FAILED
        result["summary"] = "; ".join(f"{r['config']} {r['failed_role']}: {r['error']}" for r in failures)
    elif not fit_ok:
        status = EXIT_CHECK_FAILED
        result["summary"] = (f"the {primary['config']} {primary_mode} fit has no positive per-descriptor term and finite "
                             f"bandwidth: {pf['per_descriptor_s']:.3g} s, {pf['bandwidth_bytes_per_s']:.3g} B/s")
    else:
        result["summary"] = (f"{len(result['runs'])} config(s) x {len(args.modes or MODES)} modes x {len(points)} points, bytes verified; "
                             f"{primary['config']} {primary_mode}: {pf['fixed_per_transfer_s'] * 1e6:.1f} us/transfer + "
                             f"{pf['per_descriptor_s'] * 1e9:.0f} ns/descriptor + bytes / "
                             f"{pf['bandwidth_bytes_per_s'] / 2 ** 30:.2f} GiB/s; {result['wall_s']:.1f} s")
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        _print_report(result)
    for r in failures:
        print(f"error: {r['config']} {r['failed_role']}: {r['error']}\n{r.get('log_tail', '')}", file=sys.stderr)
    if status == EXIT_NIXL_UNAVAILABLE:
        print(f"error: NIXL/UCX cannot start. Is nixl installed for {sys.executable}? If UCX_TLS is set it must "
              "include tcp.", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=f"NIXL loopback micro-benchmark ({LABEL})")
    ap.add_argument("--quick", action="store_true", help="small grid (< 30 s)")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), help="agent configs to run (default: all)")
    ap.add_argument("--reps", type=int, default=0, help="timed repetitions per point and mode (default: 15, --quick 7)")
    ap.add_argument("--block-sizes", type=float, nargs="+", metavar="KIB", help="override the grid's block sizes, KiB")
    ap.add_argument("--counts", type=int, nargs="+", help="override the grid's blocks per transfer")
    ap.add_argument("--max-transfer-mib", type=float, help="skip points moving more (default: 128, --quick 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a side may wait for the other")
    ap.add_argument("--port", type=int, default=0, help="target side-channel port (default 0: a free one)")
    ap.add_argument("--poll-interval", type=float, default=0.001,
                    help="seconds between the target's get_new_notifs calls (default 0.001)")
    ap.add_argument("--modes", nargs="+", choices=list(MODES),
                    help="transfer modes to time, the first one is fitted for the verdict (default: all)")
    ap.add_argument("--log-dir", help="keep each child's NIXL/UCX log and JSON here (default: a temporary dir)")
    # child roles
    ap.add_argument("--role", choices=["target", "initiator"], help=argparse.SUPPRESS)
    ap.add_argument("--config", choices=list(CONFIGS), help=argparse.SUPPRESS)
    ap.add_argument("--region-bytes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--grid", help=argparse.SUPPRESS)
    ap.add_argument("--ready-file", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "target":
        return _child_main(lambda: target(args), args.out)
    if args.role == "initiator":
        return _child_main(lambda: initiator(args), args.out)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
