"""Workloads: synthetic multi-turn (vLLM multi-turn benchmark parameters), agentic tool loops, and
Mooncake trace replay; all produce :class:`sim.workload.model.Conversation`."""
from sim.workload.model import Conversation, Turn

__all__ = ["Conversation", "Turn"]
