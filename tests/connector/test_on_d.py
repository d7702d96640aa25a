"""D serving a later turn whole (prefill on D), at the scheduler level: a real vLLM 0.32 scheduler with our
connector; NIXL faked at the transfer boundary only (tests.connector.harness).

What holds: a request arriving at D with the history D holds takes from D's prefix cache the blocks D
loaded from P and the full blocks D generated, whether the previous turn is still retained (pinned) or was
freed into the cache; a history that differs in a token takes nothing beyond the last whole block before
it; once the turn answered, the retained turn it names in ``bidikv_supersedes`` is released (its deadline
re-sent as now), and only then.
"""

from __future__ import annotations

import pytest

import vllm  # noqa: F401  (part of the test setup: a missing vLLM is a failure, not a skip)
from vllm.v1.request import RequestStatus  # noqa: E402

from impl.policy.prefill_on_d import SUPERSEDES_KEY
from impl.router.on_d import ON_D_PARAMS
from tests.connector.harness import (
    BLOCK_SIZE,
    connector_scheduler,
    make_request,
    model_output,
    prefill_params,
    tokens,
)
from tests.connector.test_scheduler import decode_node, release, run

PROMPT = 64  # two blocks loaded from P
ANSWER = 40  # D generates 40 tokens: the prompt's 64 and the first 32 of them fill a third block
SUFFIX = 20


def _first_turn(scheduler, seed: int):
    """Turn 1 the disaggregated way: D loads the prompt's KV from P, decodes, retains the turn."""
    first = make_request(tokens(PROMPT, seed), prefill_params(num_blocks=2, remote_num_tokens=PROMPT),
                         max_tokens=ANSWER)
    scheduler.add_request(first)
    out = run(scheduler, first, max_steps=ANSWER + 10)
    assert out["do_remote_decode"] is True and first.request_id in connector_scheduler(scheduler)._retained
    return first, out


def _on_d(history: list[int], previous_out: dict | None, seed: int, **extra):
    params = dict(ON_D_PARAMS)
    if previous_out is not None:
        params[SUPERSEDES_KEY] = {"request_id": previous_out["remote_request_id"],
                                  "engine_id": previous_out["remote_engine_id"]}
    params.update(extra)
    return make_request(history + tokens(SUFFIX, seed), params, max_tokens=4)


def _hit_of(scheduler, request) -> int:
    """Tokens of ``request``'s prompt vLLM took from D's prefix cache when it scheduled it."""
    scheduler.add_request(request)
    so = scheduler.schedule()
    hit = request.num_prompt_tokens - so.num_scheduled_tokens[request.request_id]
    scheduler.update_from_output(so, model_output([request]))  # the step's model output: the prompt computed
    return hit


def test_a_turn_on_d_reuses_loaded_and_generated_blocks_and_releases_its_predecessor(model_dir):
    scheduler = decode_node(model_dir)
    cs = connector_scheduler(scheduler)
    first, out = _first_turn(scheduler, seed=41)
    expiry = cs._retained[first.request_id][1]
    history = list(first.prompt_token_ids) + list(first.output_token_ids)
    second = _on_d(history, out, seed=42)
    # whole blocks of what D computed: the two it loaded and the one it filled generating (KV of the last
    # sampled token was never computed)
    assert _hit_of(scheduler, second) == (PROMPT + ANSWER - 1) // BLOCK_SIZE * BLOCK_SIZE == 96
    assert first.request_id in cs._retained, "released before the successor answered"
    stats: dict[str, float] = {}
    second_out = run(scheduler, second, stats=stats)
    assert second_out["do_remote_decode"] is True and second.request_id in cs._retained  # the successor is kept
    assert first.request_id not in cs._retained and cs.superseded_outcomes == {"released": 1}
    # the deadline the worker enforces is re-sent as now, long before the TTL
    deadline = scheduler.schedule().kv_connector_metadata.reqs_to_send[first.request_id]
    assert deadline == cs._clock() < expiry
    assert stats["bidikv_superseded_released"] == 1 and stats["bidikv_superseded_seconds"] == pytest.approx(20.0)


def test_freed_but_cached_blocks_still_serve_the_next_turn(model_dir):
    scheduler = decode_node(model_dir)
    first, out = _first_turn(scheduler, seed=43)
    release(scheduler, first.request_id)  # the TTL passed (or a give-back): the blocks go to the free queue
    assert first.request_id not in scheduler.requests
    second = _on_d(list(first.prompt_token_ids) + list(first.output_token_ids), out, seed=44)
    assert _hit_of(scheduler, second) == 96
    run(scheduler, second)
    assert connector_scheduler(scheduler).superseded_outcomes == {"not_held": 1}


@pytest.mark.parametrize("diverge_at, hit", [(70, 64), (64, 64), (63, 32), (10, 0)])
def test_a_history_differing_in_one_token_reuses_nothing_beyond_it(model_dir, diverge_at, hit):
    """vLLM's chained block hashes: a re-rendered or re-tokenized history hits only the whole blocks before
    the first token that differs (its KV is never reused for other ids)."""
    scheduler = decode_node(model_dir)
    first, out = _first_turn(scheduler, seed=45)
    history = list(first.prompt_token_ids) + list(first.output_token_ids)
    history[diverge_at] = 2 if history[diverge_at] != 2 else 4
    assert _hit_of(scheduler, _on_d(history, out, seed=46)) == hit


def test_an_aborted_successor_leaves_its_predecessor_retained(model_dir):
    scheduler = decode_node(model_dir)
    cs = connector_scheduler(scheduler)
    first, out = _first_turn(scheduler, seed=47)
    second = _on_d(list(first.prompt_token_ids) + list(first.output_token_ids), out, seed=48)
    _hit_of(scheduler, second)
    scheduler.finish_requests(second.request_id, RequestStatus.FINISHED_ABORTED)
    assert first.request_id in cs._retained and not cs.superseded_outcomes


@pytest.mark.parametrize("value, outcome", [
    ({"request_id": "nope", "engine_id": None}, "malformed"),
    ("req-1", "malformed"),
    ({"request_id": "other", "engine_id": "another-engine"}, "other_engine"),
])
def test_a_bad_or_foreign_supersedes_releases_nothing(model_dir, value, outcome):
    scheduler = decode_node(model_dir)
    cs = connector_scheduler(scheduler)
    first, out = _first_turn(scheduler, seed=49)
    second = _on_d(list(first.prompt_token_ids) + list(first.output_token_ids), None, seed=50, **{SUPERSEDES_KEY: value})
    scheduler.add_request(second)
    run(scheduler, second)
    assert first.request_id in cs._retained and cs.superseded_outcomes == {outcome: 1}

