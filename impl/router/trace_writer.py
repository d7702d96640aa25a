"""``--trace-out DIR``: the router's per-turn trace (format: :mod:`impl.trace.format`), written off the
event loop so that no turn ever waits for a disk.

A turn's line is handed to a bounded queue (``put_nowait``: a full queue drops the line and counts it)
and a writer thread appends it to the current file, flushing after each batch it drains. Files rotate
when they pass ``max_file_bytes`` or ``rotate_s``; at most ``max_files`` are kept (the oldest is deleted),
so the disk the trace takes is bounded by ``max_files * max_file_bytes`` plus one line. A write that fails
(disk full, directory gone) drops the line, counts it, and the next line tries a new file.

Sampling is by conversation: a conversation is in the trace iff its keyed hash falls below the rate, so
a sampled conversation has all its turns and an unsampled one none.

Who is who (:class:`TraceLineage`): a conversation named by the client (an id, a prompt_cache_key) is the
keyed hash of that name; one found by its history inherits the conversation of the turn it continues
(the turn stored under the key it was looked up by), else starts a new one. Bounded like the store.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from impl.trace.format import TraceHeader, TraceTurn, keyed_hash, salt_id

if TYPE_CHECKING:
    from impl.router.capture import TurnCapture
    from impl.router.metrics import RouterMetrics
    from impl.router.request import TurnRequest

log = logging.getLogger("bidikv.router")
_STOP = object()


class TraceWriter:
    def __init__(self, directory: str | os.PathLike[str], salt: bytes, *, sample_rate: float = 1.0,
                 max_file_bytes: int = 64 * 1024 * 1024, rotate_s: float = 3600.0, max_files: int = 24,
                 queue_lines: int = 10_000, router_name: str = "", wall_clock: Callable[[], float] = time.time) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"trace sample rate must be in (0, 1], got {sample_rate!r}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)  # at start-up: a bad path stops the router, not a turn
        self.salt = salt
        self.sample_rate = sample_rate
        self.max_file_bytes, self.rotate_s, self.max_files = max_file_bytes, rotate_s, max_files
        self.router_name = router_name
        self.wall_clock = wall_clock
        self.written = self.dropped_full = self.dropped_error = 0
        self._queue: queue.Queue = queue.Queue(maxsize=queue_lines)
        self._file = None
        self._file_bytes = 0
        self._file_opened = 0.0
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="bidikv-trace", daemon=True)
        self._thread.start()

    def sampled(self, conversation: str) -> bool:
        return int(conversation[:8], 16) < self.sample_rate * 0x1_0000_0000

    def submit(self, turn: TraceTurn) -> bool:
        """Queue ``turn``'s line; False (and counted) if the writer is behind and the queue is full."""
        try:
            self._queue.put_nowait(turn.line())
            return True
        except queue.Full:
            self.dropped_full += 1
            return False

    # -- the writer thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            while True:  # drain what is there: one flush for a burst
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(line is _STOP for line in batch)
            lines = [line for line in batch if line is not _STOP]
            if lines:
                self._write(lines)
            if stop:
                self._close_file()
                return

    def _write(self, lines: list[str]) -> None:
        for line in lines:
            try:
                self._ensure_file()
                data = line + "\n"
                self._file.write(data)
                self._file_bytes += len(data)
                self.written += 1
            except OSError as e:
                self.dropped_error += 1
                if self.dropped_error == 1 or self.dropped_error % 1000 == 0:
                    log.warning("trace: dropped a line (%s: %s); %d dropped so far", type(e).__name__, e,
                                self.dropped_error)
                self._close_file()  # the next line tries a new file
        try:
            if self._file is not None:
                self._file.flush()
        except OSError:
            self._close_file()

    def _ensure_file(self) -> None:
        now = self.wall_clock()
        if self._file is not None and (self._file_bytes >= self.max_file_bytes or now - self._file_opened >= self.rotate_s):
            self._close_file()
        if self._file is not None:
            return
        self._seq += 1
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        path = self.directory / f"trace-{stamp}-{os.getpid()}-{self._seq:05d}.jsonl"
        self._file = open(path, "a", encoding="utf-8")
        header = TraceHeader(started_at=round(now, 3), salt_id=salt_id(self.salt), sample_rate=self.sample_rate,
                             router=self.router_name).line() + "\n"
        self._file.write(header)
        self._file_bytes, self._file_opened = len(header), now
        self._prune()

    def _prune(self) -> None:
        files = sorted(self.directory.glob("trace-*.jsonl"), key=lambda p: (p.stat().st_mtime, p.name))
        for old in files[:-self.max_files] if len(files) > self.max_files else ():
            try:
                old.unlink()
            except OSError:
                pass

    def _close_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued and stop (shutdown)."""
        while True:
            try:
                self._queue.put(_STOP, timeout=timeout_s)
                break
            except queue.Full:
                return
        self._thread.join(timeout_s)


class TraceLineage:
    """Which conversation a turn belongs to and its index there, as the trace names them."""

    def __init__(self, salt: bytes, max_entries: int) -> None:
        self.salt = salt
        self.max_entries = max_entries
        self._next: collections.OrderedDict[tuple[str, str], tuple[str, int]] = collections.OrderedDict()

    def tenant(self, tenant: str) -> str:
        return keyed_hash(self.salt, "tenant", tenant)

    def place(self, tenant: str, named: str | None, parent: str | None, stored: str | None, answers: int,
              request_id: str) -> tuple[str, int]:
        """``named``: the client's name for the conversation (None: found by history or not at all);
        ``parent``: the key it was looked up by first; ``stored``: the key it is stored under;
        ``answers``: how many answers its history holds (a conversation first seen mid-way)."""
        if named is not None:
            conversation = keyed_hash(self.salt, "conversation", tenant, named)
            previous = self._next.get((tenant, named))
            index = previous[1] if previous is not None else answers
            self._remember((tenant, named), conversation, index + 1)
            return conversation, index
        found = self._next.get((tenant, parent)) if parent is not None else None
        if found is not None:
            conversation, index = found
        else:
            conversation, index = keyed_hash(self.salt, "conversation", tenant, "\x00turn", request_id), answers
        if stored is not None:
            self._remember((tenant, stored), conversation, index + 1)
        return conversation, index

    def _remember(self, key: tuple[str, str], conversation: str, next_index: int) -> None:
        self._next[key] = (conversation, next_index)
        self._next.move_to_end(key)
        while len(self._next) > self.max_entries:
            self._next.popitem(last=False)


class TurnTracer:
    """What the proxy hands over at the end of a turn, turned into one trace line (or none: unsampled)."""

    def __init__(self, writer: TraceWriter, lineage: TraceLineage, metrics: "RouterMetrics",
                 public_names: dict[str, str]) -> None:
        self.writer, self.lineage, self.metrics, self.names = writer, lineage, metrics, public_names

    def record(self, *, turn: "TurnRequest", tenant: str, request_id: str, arrival: float, status: int,
               stored: str | None, offered: int, miss: str | None, prompt_tokens: int | None,
               cached_tokens: int | None, report: dict[str, Any] | None, capture: "TurnCapture | None",
               prefill: str | None, decode: str | None, finished_after_s: float | None, path: str | None = None,
               tier: str | None = None) -> None:
        named = turn.conversation_id if turn.match in ("id", "prompt_cache_key") else None
        parent = turn.store_id if turn.match == "history" else None
        conversation, index = self.lineage.place(tenant, named, parent, stored, turn.answers_in_history(), request_id)
        if not self.writer.sampled(conversation):
            self.metrics.trace_unsampled.inc()
            return
        output = capture.output_tokens if capture is not None else None
        ttft = capture.first_token_s if capture is not None else None
        tpot = None
        if capture is not None and ttft is not None and finished_after_s is not None and output and output > 1:
            tpot = round(max(0.0, finished_after_s - ttft) / (output - 1), 6)
        counts = report if isinstance(report, dict) else {}
        self.writer.submit(TraceTurn(
            t=round(arrival, 6), conversation=conversation, tenant=self.lineage.tenant(tenant), turn=index,
            match=turn.match, miss=miss,
            status=status, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens, output_tokens=output,
            offered=offered, verified=_count(counts.get("verified")), pulled=_count(counts.get("pulled")),
            ttft_s=None if ttft is None else round(ttft, 6), tpot_s=tpot,
            finish_s=None if finished_after_s is None else round(finished_after_s, 6),
            prefill=self.names.get(prefill, prefill) if prefill else None,
            decode=self.names.get(decode, decode) if decode else None, path=path,
            tier=tier))


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None
