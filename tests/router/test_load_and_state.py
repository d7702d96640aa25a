"""Load (200 concurrent multi-turn conversations, nothing lost or mixed up) and a hypothesis state
machine checking the store against a model through faults, rewrites and foreign tenants."""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from tests.router.fakes import expected_answer, prompt_tag
from tests.router.harness import Deployment, LoopThread

CONVERSATIONS = 200
TURNS = 3


async def test_200_concurrent_conversations_no_lost_or_mixed_turns():
    async with Deployment(n_prefill=2, n_decode=2, style="final_chunk", placement="least_loaded", chunks=4) as dep:
        answers: dict[str, list[str]] = {}

        async def conversation(i: int) -> None:
            cid = f"conv-{i}"
            history = [{"role": "user", "content": f"[{cid}] turn 0"}]
            answers[cid] = []
            for turn in range(TURNS):
                r = await dep.chat(history, conversation_id=cid)
                assert r.status == 200 and r.done and r.error is None, (cid, turn, r.status, r.error)
                assert r.answer == expected_answer({"messages": history}, 4), (cid, turn)  # its own answer
                answers[cid].append(r.answer)
                history = history + [{"role": "assistant", "content": r.answer},
                                     {"role": "user", "content": f"[{cid}] turn {turn + 1}"}]

        await asyncio.gather(*(conversation(i) for i in range(CONVERSATIONS)))  # a hang fails at the test's deadline
        await dep.settle()
        assert all(len(a) == TURNS for a in answers.values())
        m = dep.router.metrics
        assert m.reuse_hits.get() == CONVERSATIONS * (TURNS - 1)
        assert m.turns_stored.get("final_chunk") == CONVERSATIONS * TURNS
        # every reuse offered to P is the previous turn of the same conversation, from the D that served it
        issued = {rid: tag for d in dep.decodes for rid, tag in d.issued_d_params.items()}
        checked = 0
        for p in dep.prefills:
            for body in p.prefill_requests():
                params = body["kv_transfer_params"]
                if not params.get("remote_block_ids"):
                    continue
                previous_prompt = {"messages": body["messages"][:-2]}
                assert issued[params["remote_request_id"]] == prompt_tag(previous_prompt)
                assert params["remote_engine_id"] == "D-" + params["remote_request_id"].split("-")[1]
                checked += 1
        assert checked == CONVERSATIONS * (TURNS - 1)
        assert len(dep.router.store) == CONVERSATIONS
        assert len(dep.router.hub) == 0  # no notify registration leaked


async def test_store_bound_evicts_lru_under_an_id_flood():
    async with Deployment(max_conversations=50) as dep:
        results = await asyncio.gather(*(dep.chat([{"role": "user", "content": f"x{i}"}], conversation_id=f"flood-{i}")
                                         for i in range(120)))
        failed = [(i, r.status, r.error) for i, r in enumerate(results) if r.status != 200 or not r.done]
        assert not failed, failed[:5]
        # no settling: a streamed turn is stored before its client sees [DONE], so a client's next turn
        # always finds it (the fakes put D's params on the final chunk: no notification to wait for)
        assert dep.router.store.stats.evictions + len(dep.router.store) == 120, dep.router.store.stats
        assert len(dep.router.store) == 50
        assert dep.router.store.stats.evictions == 70
        assert len(dep.router.proxy.affinity) <= 50


class RouterStoreMachine(RuleBasedStateMachine):
    """Model: per (tenant, conversation) the history that continues the stored turn and that turn's D
    request id. Rules drive real HTTP turns through the router; the store must always match."""

    lt: LoopThread

    def __init__(self) -> None:
        super().__init__()
        self.dep = Deployment(keys={"acme": "ka", "globex": "kg"}, decode_idle_timeout_s=0.3, notify_wait_s=0.5)
        self.lt.run(self.dep.__aenter__())
        # key -> (next history, stored rid, or None once a failed turn took the entry: offered once)
        self.model: dict[tuple[str, str], tuple[list[dict], str | None]] = {}
        self.step = 0

    def teardown(self) -> None:
        self.lt.run(self.dep.__aexit__(None, None, None))

    def _turn(self, tenant: str, cid: str, history: list[dict]):
        key = {"acme": "ka", "globex": "kg"}[tenant]
        return self.lt.run(self.dep.chat(history, conversation_id=cid, key=key))

    def _history(self, key: tuple[str, str]) -> list[dict]:
        self.step += 1
        if key in self.model:
            return self.model[key][0]
        return [{"role": "user", "content": f"{key} start {self.step}"}]

    def _last_p_params(self) -> dict:
        return self.dep.p.prefill_requests()[-1]["kv_transfer_params"]

    def _expect_reuse_of(self, key: tuple[str, str]) -> None:
        params = self._last_p_params()
        if key in self.model and self.model[key][1] is not None:
            assert params.get("remote_request_id") == self.model[key][1]
        else:
            assert not params.get("remote_block_ids")

    @rule(tenant=st.sampled_from(["acme", "globex"]), cid=st.sampled_from(["c0", "c1", "c2"]),
          style=st.sampled_from(["final_chunk", "notify"]))
    def good_turn(self, tenant, cid, style):
        key = (tenant, cid)
        history = self._history(key)
        self.dep.d.style, self.dep.d.fault = style, None
        r = self._turn(tenant, cid, history)
        assert r.status == 200 and r.done and r.error is None
        self._expect_reuse_of(key)
        self.lt.run(self.dep.settle())
        rid = self.dep.router.store.get(tenant, cid).kv_params["remote_request_id"]
        assert self.dep.d.issued_d_params[rid] == prompt_tag({"messages": history})
        self.model[key] = (history + [{"role": "assistant", "content": r.answer},
                                      {"role": "user", "content": f"next {self.step}"}], rid)

    @rule(tenant=st.sampled_from(["acme", "globex"]), cid=st.sampled_from(["c0", "c1", "c2"]),
          fault=st.sampled_from(["kill_mid_stream", "no_done", "error_event", "malformed_final", "stall", "http_500"]))
    def failed_turn(self, tenant, cid, fault):
        key = (tenant, cid)
        history = self._history(key)
        self.dep.d.style, self.dep.d.fault, self.dep.d.slow_s = "final_chunk", fault, 1.0
        r = self._turn(tenant, cid, history)
        self.dep.d.fault = None
        assert r.status in (200, 502)
        if fault != "malformed_final":
            assert r.error is not None
        self._expect_reuse_of(key)  # the lookup before the failure still offered the stored turn
        self.lt.run(self.dep.settle())  # the failed turn stored nothing, and its offer took the entry
        if key in self.model:
            self.model[key] = (self.model[key][0], None)

    @precondition(lambda self: any(rid is not None for _, rid in self.model.values()))
    @rule(data=st.data())
    def rewritten_turn(self, data):
        key = data.draw(st.sampled_from(sorted(k for k, (_, rid) in self.model.items() if rid is not None)))
        history = [dict(m) for m in self.model[key][0]]
        history[-2]["content"] = history[-2]["content"][:-1] + "#"  # the last answer, altered
        self.dep.d.style, self.dep.d.fault = "final_chunk", None
        r = self._turn(key[0], key[1], history)
        assert r.status == 200 and r.done
        assert not self._last_p_params().get("remote_block_ids")  # the guard refused
        self.lt.run(self.dep.settle())
        rid = self.dep.router.store.get(*key).kv_params["remote_request_id"]
        self.model[key] = (history + [{"role": "assistant", "content": r.answer},
                                      {"role": "user", "content": f"after rewrite {self.step}"}], rid)

    @invariant()
    def store_matches_model(self):
        store = self.dep.router.store
        for (tenant, cid), (_, rid) in self.model.items():
            entry = store.get(tenant, cid)
            if rid is None:
                assert entry is None
            else:
                assert entry is not None and entry.kv_params["remote_request_id"] == rid
        for tenant in ("acme", "globex"):
            for cid in ("c0", "c1", "c2"):
                if (tenant, cid) not in self.model:
                    assert store.get(tenant, cid) is None
        assert len(self.dep.router.hub) == 0 or self.dep.router.proxy.recorder._background


def test_store_consistency_state_machine():
    lt = LoopThread()
    RouterStoreMachine.lt = lt
    try:
        run_state_machine_as_test(RouterStoreMachine, settings=settings(
            max_examples=8, stateful_step_count=12, deadline=None, suppress_health_check=list(HealthCheck)))
    finally:
        lt.close()
