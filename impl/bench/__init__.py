"""``bidikv bench``: multi-turn conversations against a router (or any OpenAI-compatible URL), from
the simulator's own workload generators, recording per turn what calibration reads back
(``bidikv calibrate --from-bench``): observe -> replay -> calibrate share this one JSONL format."""
