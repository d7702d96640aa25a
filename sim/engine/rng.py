"""Per-subsystem random streams derived from one seed.

Each subsystem (workload, gaps, placement, jitter, ...) owns a ``random.Random`` seeded from
``"<seed>:<name>"``; string seeding hashes with SHA-512 (version 2), so streams are stable across
runs and platforms, and adding a subsystem never reshuffles an existing one.
"""

from __future__ import annotations

import random


def stream(seed: int, name: str) -> random.Random:
    return random.Random(f"{seed}:{name}")
