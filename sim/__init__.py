"""The simulator: a simpy model of router, prefill nodes, decode nodes and the EFA interconnect.

Every decision is taken by impl.policy (the same code the real router and connector run); sim/ holds
only the mechanics: queues, batches, block pools, links, and the clock."""

from sim import native as _native

_native.install_guard()  # a compiled build whose sources changed since must not run (sim/native.py)
