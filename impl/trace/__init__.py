"""The router's per-turn trace: one format that the router writes and the simulator, the tuner and
``validate`` read (the observe -> replay -> calibrate loop). :mod:`~impl.trace.format` holds the format
and nothing else (standard library only, no I/O), so both halves import it."""
