"""``bidikv bench`` with vLLM's multi-turn benchmark client loop, against a deployment.

The conversations come from the same config and seed as ``bidikv simulate``'s
(:mod:`sim.workload.vllm_multi_turn`), and each client follows the same rule
(:class:`sim.clients.bench.VllmClient`: round robin over its active conversations, early stop), so
the two describe one run. Prompts are token ids: request 0 is the common prefix (the same ids in
every conversation, so a prefix cache can share them as it shares vLLM's common text) followed by
the conversation's own ids; request k is the previous prompt, the ids the server answered, and the
new user message's planned length of fresh ids. Requests ask for ``max_tokens`` only with the
server's sampling defaults, as vLLM's client does, so an answer may end early at EOS and the next
prompt is then shorter than the simulator's plan (which cannot see EOS).

Outcomes as in vLLM's client: an HTTP error drops the conversation and the client goes on; any
other failure (timeout, broken stream) stops the client, which with early stop ends the run.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Sequence

import aiohttp

from sim.bench.client import _model_info, _turn, turn_record
from sim.bench.config import BenchConfig
from calibration.bench_records import BenchRecord
from sim.clients.bench import VllmClient, VllmClientConfig, make_clients
from sim.engine.rng import stream
from sim.workload.model import Conversation
from sim.workload.vllm_multi_turn import user_tokens


class PromptBuilder:
    """Token-id prompts of every conversation: shared common prefix, then each conversation's own ids."""

    def __init__(self, config: BenchConfig, conversations: Sequence[Conversation]) -> None:
        self._config = config
        common = max((c.shared_prefix_tokens for c in conversations), default=0)
        rng = stream(config.seed, "bench-common-prefix")
        self._common = [rng.randrange(config.token_id_low, config.token_id_high) for _ in range(common)]
        self._history: dict[str, list[int]] = {}
        self._rngs: dict[str, random.Random] = {}

    def prompt(self, conv: Conversation, index: int) -> list[int]:
        """Request ``index``: what came before (as the server answered it) and the new user ids."""
        key = conv.conversation_id
        rng = self._rngs.setdefault(key, random.Random(f"{self._config.seed}:bench:{key}"))
        if index == 0:
            shared = self._common[:conv.shared_prefix_tokens]
            return shared + self._ids(rng, conv.turns[0].prompt_tokens - len(shared))
        return self._history[key] + self._ids(rng, user_tokens(conv)[index])

    def answered(self, conv: Conversation, prompt: list[int], generated: list[int]) -> None:
        self._history[conv.conversation_id] = prompt + generated

    def _ids(self, rng: random.Random, count: int) -> list[int]:
        return [rng.randrange(self._config.token_id_low, self._config.token_id_high) for _ in range(count)]


async def run_vllm_bench(config: BenchConfig, conversations: Sequence[Conversation], client_config: VllmClientConfig,
                         num_clients: int) -> list[BenchRecord]:
    """Every request the clients sent, in start order (turns never sent, after an early stop, are absent)."""
    clients = make_clients(client_config, num_clients, conversations, config.seed)
    prompts = PromptBuilder(config, conversations)
    records: list[BenchRecord] = []
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        model, _ = await _model_info(session, config)
        t0 = time.perf_counter()

        async def run_client(client: VllmClient) -> None:
            while (request := client.next_request()) is not None:
                conv, index = request
                prompt = prompts.prompt(conv, index)
                start = time.perf_counter() - t0
                result = await _turn(session, config, model, conv.conversation_id, prompt,
                                     conv.turns[index].output_tokens, exact_length=False)
                records.append(turn_record(config, conv.conversation_id, index, len(prompt), start, result))
                if not result.error:
                    prompts.answered(conv, prompt, result.generated)
                if not client.done(ok=not result.error,
                                   exception=bool(result.error) and not result.error.startswith("HTTP ")):
                    break
                pause = client.pause_s(result.total_s)
                if pause > 0:
                    await asyncio.sleep(pause)

        await asyncio.gather(*(run_client(c) for c in clients))
    records.sort(key=lambda r: (r.start_s, r.conversation, r.turn))
    return records
