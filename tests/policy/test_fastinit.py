"""impl.policy.fastinit.frozen_init: the same objects as the dataclass's own ``__init__`` builds.

Each class that uses it is compared with a twin made by ``dataclasses.make_dataclass`` from the same
fields (the generated ``__init__`` frozen_init replaced), on hypothesis-drawn values, positionally and
by keyword; and what a frozen dataclass promises (no assignment, ``replace``, ``__post_init__``) holds.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, strategies as st

from impl.policy import ConversationEntry, PullCandidate
from impl.policy.fastinit import frozen_init
from impl.policy.recompute import DecisionReason, RecomputeDecision, TransferPath
from impl.policy.store import Lookup, MissReason
from sim.workload.model import Conversation, Turn

CLASSES = (ConversationEntry, Lookup, PullCandidate, RecomputeDecision, Turn, Conversation)


def _twin(cls: type) -> type:
    """``cls``'s fields in a plain frozen slotted dataclass: its ``__init__`` is dataclasses' own."""
    fields = [(f.name, f.type, dataclasses.field(default=f.default) if f.default is not dataclasses.MISSING
               else dataclasses.field()) for f in dataclasses.fields(cls)]
    return dataclasses.make_dataclass(f"{cls.__name__}Twin", fields, frozen=True, slots=True)


def _state(obj: object) -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_user_is_a_frozen_dataclass_with_the_fast_init(cls):
    assert cls.__init__.__qualname__ == f"{cls.__qualname__}.__init__"
    assert cls.__init__ is not _twin(cls).__init__
    assert cls.__dataclass_params__.frozen


values = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=False), st.text(max_size=5), st.none(),
                   st.booleans())


@given(st.data())
def test_same_fields_as_the_generated_init_positionally_and_by_keyword(data):
    # ConversationEntry, Lookup and Turn validate nothing, so any values go: the fields must come out as given
    for cls in (ConversationEntry, Lookup, Turn):
        fields = dataclasses.fields(cls)
        required = [f for f in fields if f.default is dataclasses.MISSING]
        given_n = data.draw(st.integers(len(required), len(fields)))
        args = [data.draw(values) for _ in range(given_n)]
        twin = _twin(cls)
        assert _state(cls(*args)) == _state(twin(*args))
        kwargs = {f.name: a for f, a in zip(fields, args)}
        assert _state(cls(**kwargs)) == _state(twin(**kwargs)) == _state(cls(*args))


def test_defaults_missing_arguments_and_frozenness():
    turn = Turn(100, 10)
    assert (turn.gap_before_s, turn.arrival_s, turn.history_revision, turn.tool_call,
            turn.reuse_agreement_tokens) == (0.0, None, 0, False, None)
    with pytest.raises(TypeError):
        Turn(100)  # output_tokens has no default
    with pytest.raises(TypeError):
        Turn(100, 10, prompt_tokens=5)  # given twice
    with pytest.raises(dataclasses.FrozenInstanceError):
        turn.prompt_tokens = 5  # type: ignore[misc]
    assert dataclasses.replace(turn, output_tokens=20) == Turn(100, 20)
    assert Lookup(None, MissReason.UNKNOWN) == Lookup(None, MissReason.UNKNOWN)
    assert hash(Turn(1, 2)) == hash(Turn(1, 2))


def test_post_init_still_runs_and_validates():
    candidate = PullCandidate(1000, 512, 0, 16, TransferPath.DECODE_TO_PREFILL)
    assert candidate.reusable_tokens == 512
    with pytest.raises((ValueError, TypeError)):
        PullCandidate(1000, 512, 0, 0, TransferPath.DECODE_TO_PREFILL)  # a block size of 0
    decision = RecomputeDecision(True, 512, DecisionReason.PULL_CHEAPER)
    assert (decision.predicted_pull_s, decision.predicted_recompute_s) == (None, None)
    conv = Conversation("c", 0.0, (Turn(10, 1),))
    assert conv.tenant == "default" and conv.shared_prefix_tokens == 0


def test_refuses_classes_it_cannot_serve():
    @dataclasses.dataclass
    class Mutable:
        x: int

    with pytest.raises(TypeError, match="frozen"):
        frozen_init(Mutable)

    @dataclasses.dataclass(frozen=True, slots=True)
    class WithFactory:
        x: list = dataclasses.field(default_factory=list)

    with pytest.raises(TypeError, match="positional"):
        frozen_init(WithFactory)
