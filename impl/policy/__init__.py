"""The decisions of bidirectional KV transfer, shared verbatim by the simulator (sim/) and the real
vLLM connector and router (impl/).

Reading guide, one concern per module:

* :mod:`~impl.policy.catalogue`    -- every setting (one name, default, bounds, help) and the registries
  that choose each family's policy by name; every surface is built from it
* :mod:`~impl.policy.recompute`    -- pull KV from a peer or recompute it (``kv_recompute_threshold``)
* :mod:`~impl.policy.retention`    -- how long D keeps a finished turn's blocks (``decoder_kv_blocks_ttl``)
* :mod:`~impl.policy.pressure`     -- which retained blocks go first when a decode node runs short
* :mod:`~impl.policy.give_back`    -- giving them back without ever freeing a block P may still read
* :mod:`~impl.policy.store`        -- the router's conversation -> KV-location map
* :mod:`~impl.policy.continuation` -- the guard that a new prompt continues the held sequence
* :mod:`~impl.policy.placement`    -- which P and D instance serve a turn
* :mod:`~impl.policy.prefill_on_d` -- pull to P, prefill on the D that holds the conversation, or recompute

Rules for this package: standard library only, no I/O, no globals; time is passed in as ``now``
(seconds) and randomness as a ``random.Random``. A rule the simulator and the server both need lives
here and nowhere else.
"""

from impl.policy.continuation import ItemsPrompt, PromptView, canonical_messages, continues, sequence_digest
from impl.policy.give_back import GiveBack, GiveBackLedger, releases
from impl.policy.placement import (
    InstanceLoad,
    KVAwareCost,
    LeastLoaded,
    LeastLoadedIndex,
    PlacementPolicy,
    PlacementRequest,
    RoundRobin,
)
from impl.policy.pressure import BlockHolder, RetainedPool, VictimChoice, choose_victims
from impl.policy.recompute import (
    BreakEvenThreshold,
    DecisionReason,
    FixedThreshold,
    KVCostModel,
    PullCandidate,
    RecomputeDecision,
    RecomputePolicy,
    TransferPath,
)
from impl.policy.retention import FixedTTL, GapQuantileTTL, HeartbeatLease, RetentionPolicy
from impl.policy.store import ConversationEntry, ConversationStore, Lookup, MissReason

__all__ = [
    "BlockHolder", "BreakEvenThreshold", "ConversationEntry", "ConversationStore", "DecisionReason",
    "FixedTTL", "FixedThreshold", "GapQuantileTTL", "GiveBack", "GiveBackLedger", "HeartbeatLease", "InstanceLoad", "ItemsPrompt",
    "KVAwareCost", "KVCostModel", "LeastLoaded", "LeastLoadedIndex", "Lookup", "MissReason", "PlacementPolicy",
    "PlacementRequest", "PromptView", "PullCandidate", "RecomputeDecision", "RecomputePolicy",
    "RetainedPool", "RetentionPolicy", "RoundRobin", "TransferPath", "VictimChoice",
    "canonical_messages", "choose_victims", "continues", "releases", "sequence_digest",
]
