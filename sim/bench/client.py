"""The benchmark client: conversations from sim.workload, sent as token-id prompts, timed per turn.

Token-id prompts (``/v1/completions`` with ``prompt: [ids]``) make prompt lengths exact without a
tokenizer, and make the router's continuation guard exact. Each turn appends the workload's new user
tokens to the conversation's history (previous prompt + the ids the server generated), asks for
exactly the workload's output length (``ignore_eos``), streams, and records TTFT, total time and what
the router reports it reused. A pool of ``concurrency`` clients runs conversations one at a time,
like vLLM's multi-turn benchmark (``--num-clients``); ``gap_scale`` stretches or removes think time.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import NamedTuple, Sequence

import aiohttp

from sim.bench.config import BenchConfig
from calibration.bench_records import PATHS, BenchRecord
from sim.workload.model import Conversation


class _RateLimit:
    """Spaces turn starts at least 1/rate apart across all clients."""

    def __init__(self, rate: float) -> None:
        self.interval = 1.0 / rate if rate > 0 else 0.0
        self._next = 0.0
        self._lock = asyncio.Lock()

    async def wait(self) -> None:
        if not self.interval:
            return
        async with self._lock:
            now = time.monotonic()
            delay = self._next - now
            self._next = max(now, self._next) + self.interval
        if delay > 0:
            await asyncio.sleep(delay)


async def _model_info(session: aiohttp.ClientSession, config: BenchConfig) -> tuple[str, int]:
    async with session.get(config.url.rstrip("/") + "/v1/models") as resp:
        if resp.status != 200:
            raise ValueError(f"{config.url}/v1/models answered HTTP {resp.status}")
        data = await resp.json()
    models = data.get("data") or []
    if not models:
        raise ValueError(f"{config.url}/v1/models lists no model")
    entry = next((m for m in models if m.get("id") == config.model), models[0]) if config.model else models[0]
    return config.model or entry["id"], config.max_model_len or int(entry.get("max_model_len") or 1 << 30)


class TurnResult(NamedTuple):
    """What one streamed completion returned, as the client saw it."""

    ttft_s: float  # NaN when no token arrived
    total_s: float
    generated: list[int]
    headers: dict[str, str]
    error: str
    # Tokens parsed by the end of the read that stamped TTFT (the same read as the first token). More
    # than one when the server's frontend, the router or this client fell behind and several steps'
    # tokens came together: they were decoded before TTFT was stamped, so a TPOT over output - 1 tokens
    # would count them as decoded after it and shrink (measured on the 2-core rehearsal).
    first_read_tokens: int


async def _turn(session: aiohttp.ClientSession, config: BenchConfig, model: str, conversation_id: str,
                prompt: list[int], max_tokens: int, exact_length: bool = True) -> TurnResult:
    """One streamed completion.

    ``exact_length``: exactly ``max_tokens`` greedy tokens (ignore EOS); False: ``max_tokens`` only and the
    server's sampling defaults, as vLLM's multi-turn benchmark asks (the answer may end early at EOS)."""
    sampling = ({"min_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0} if exact_length else {})
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, **sampling, "stream": True,
            "return_token_ids": True, "conversation_id": config.wire_id(conversation_id), **config.extra_body}
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    start = time.perf_counter()
    ttft = float("nan")
    generated: list[int] = []
    first_read = -1  # tokens parsed by the end of the read that stamped TTFT; -1 until that read ends
    try:
        async with session.post(config.url.rstrip("/") + "/v1/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                return TurnResult(ttft, time.perf_counter() - start, generated, dict(resp.headers),
                                  f"HTTP {resp.status}: {text}", 0)
            buffer = b""
            async for chunk in resp.content.iter_any():
                if first_read < 0 and ttft == ttft:  # the read that stamped TTFT has been parsed
                    first_read = len(generated)
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            continue
                        obj = json.loads(data)
                        if "error" in obj:
                            return TurnResult(ttft, time.perf_counter() - start, generated, dict(resp.headers),
                                              str(obj["error"])[:200], _first(first_read, generated))
                        for choice in obj.get("choices") or []:
                            ids = choice.get("token_ids") or []
                            if (ids or choice.get("text")) and ttft != ttft:
                                ttft = time.perf_counter() - start
                            generated.extend(ids)
            return TurnResult(ttft, time.perf_counter() - start, generated, dict(resp.headers), "",
                              _first(first_read, generated))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        return TurnResult(ttft, time.perf_counter() - start, generated, {}, f"{type(exc).__name__}: {exc}"[:200],
                          _first(first_read, generated))


def _first(first_read: int, generated: list[int]) -> int:
    # the stream ended in (or before) the read that stamped TTFT: every token came with the first
    return first_read if first_read >= 0 else len(generated)


def turn_record(config: BenchConfig, conversation_id: str, index: int, prompt_tokens: int, start_s: float,
                result: TurnResult) -> BenchRecord:
    """The JSONL record of one turn from what :func:`_turn` returned and the router's headers."""
    ttft, total, generated, headers, error, first_read = result
    cached = headers.get("X-Bidikv-Prefill-Cached-Tokens")
    return BenchRecord(conversation=conversation_id, turn=index, mode=config.mode, prompt_tokens=prompt_tokens,
                       output_tokens=len(generated), start_s=start_s, ttft_s=ttft, total_s=total,
                       reuse_offered_tokens=int(headers.get("X-Bidikv-Reuse-Offered-Tokens", 0)),
                       prefill_cached_tokens=int(cached) if cached is not None else None,
                       prefill_instance=headers.get("X-Bidikv-Prefill", ""),
                       decode_instance=headers.get("X-Bidikv-Decode", ""), error=error,
                       first_read_tokens=first_read, path=_path(headers.get("X-Bidikv-Path", "")))


def _path(header: str) -> str:
    return header if header in PATHS else ""


async def run_bench(config: BenchConfig, conversations: Sequence[Conversation]) -> list[BenchRecord]:
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    records: list[BenchRecord] = []
    queue = list(conversations)
    queue.reverse()
    limit = _RateLimit(config.max_rate_per_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        model, max_len = await _model_info(session, config)
        t0 = time.perf_counter()

        async def client() -> None:
            while queue:
                conv = queue.pop()
                rng = random.Random(f"{config.seed}:bench:{conv.conversation_id}")
                history: list[int] = []
                revision = 0
                for index, turn in enumerate(conv.turns):
                    if index and turn.gap_before_s * config.gap_scale > 0:
                        await asyncio.sleep(turn.gap_before_s * config.gap_scale)
                    if turn.history_revision != revision and history:
                        revision = turn.history_revision  # the client rewrites its history: alter one old id
                        history[len(history) // 2] = config.token_id_low + (history[len(history) // 2] + 1 - config.token_id_low) % (config.token_id_high - config.token_id_low)
                    new_tokens = max(turn.prompt_tokens - len(history), 1)
                    prompt = history + [rng.randrange(config.token_id_low, config.token_id_high) for _ in range(new_tokens)]
                    if len(prompt) + turn.output_tokens > max_len:
                        break  # the conversation outgrew the model's context
                    await limit.wait()
                    start = time.perf_counter() - t0
                    result = await _turn(session, config, model, conv.conversation_id, prompt, turn.output_tokens)
                    records.append(turn_record(config, conv.conversation_id, index, len(prompt), start, result))
                    if result.error:
                        break  # a failed turn has no answer to continue from
                    history = prompt + result.generated

        await asyncio.gather(*(client() for _ in range(config.concurrency)))
    records.sort(key=lambda r: (r.start_s, r.conversation, r.turn))
    return records
