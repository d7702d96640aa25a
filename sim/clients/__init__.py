"""The simulated clients: a conversation's closed loop, vLLM's multi-turn benchmark clients, and how
clients renew a heartbeat lease."""
