"""The real thing: policies (impl.policy, shared with the simulator), the vLLM connector, the router,
the benchmark client and the deployment recipe."""
