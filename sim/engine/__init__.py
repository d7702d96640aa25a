"""The simulator's engine: cluster wiring, router, prefill and decode nodes, interconnect, records,
the configuration and the run; every decision comes from impl.policy."""
