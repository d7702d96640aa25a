"""``bidikv bench``: multi-turn conversations against a router (or any OpenAI-compatible URL), from
the simulator's own workload generators and client rules, recording per turn what calibration reads
back (``bidikv calibrate --from-bench``): observe -> replay -> calibrate share one JSONL format
(calibration.bench_records).

Here, above the simulator, because the bench sends the simulator's workloads: the deployed code in
impl never needs the simulator to run."""
