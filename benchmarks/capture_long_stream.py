"""What capturing one long streamed answer costs the router: peak memory and the longest single call
into the capture (the event loop cannot serve any other client during it), for an answer of N tokens
streamed one token per SSE event as vLLM does.

Run: ``.venv/bin/python benchmarks/capture_long_stream.py [--events 90000] [--repeat 3]``
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import tracemalloc

from impl.router.capture import TurnCapture


def events(n: int) -> list[bytes]:
    out = []
    for i in range(n):
        chunk = {"id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk", "created": 1733300000,
                 "model": "Llama-3.3-70B-Instruct", "choices": [{"index": 0, "delta": {"content": f" tok{i % 997}"},
                                                                  "logprobs": None, "finish_reason": None}]}
        out.append(json.dumps(chunk).encode())
    return out


def timed(stream: list[bytes]) -> tuple[float, float]:
    """The longest on_event and the end of the stream (ms), without tracemalloc (it slows allocation)."""
    capture = TurnCapture(chat=True)
    longest = 0.0
    for data in stream:
        t = time.perf_counter()
        capture.on_event(data)
        longest = max(longest, time.perf_counter() - t)
    t = time.perf_counter()
    capture.on_event(b"[DONE]")
    capture.finish()
    end = time.perf_counter() - t
    assert capture.complete and len(capture.answer) > 0
    return longest * 1e3, end * 1e3


def peak_mb(stream: list[bytes]) -> float:
    capture = TurnCapture(chat=True)
    tracemalloc.start()
    for data in stream:
        capture.on_event(data)
    capture.on_event(b"[DONE]")
    capture.finish()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak / 2**20


def once(stream: list[bytes]) -> tuple[float, float, float]:
    gc.collect()
    gc.freeze()  # as the router does after start-up: collections do not re-traverse the stream built above
    longest, end = timed(stream)
    return peak_mb(stream), longest, end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=90_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    stream = events(args.events)  # built before measuring: the upstream's bytes are not the capture's
    print(f"{args.events} events, {sum(map(len, stream)) / 2**20:.1f} MB of SSE data")
    for r in range(args.repeat):
        peak, longest, end = once(stream)
        print(f"run {r}: capture peak {peak:.1f} MB (tracemalloc), longest call {longest:.2f} ms, "
              f"end of stream (finish) {end:.2f} ms")


if __name__ == "__main__":
    main()
