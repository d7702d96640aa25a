"""The buckets and percentile every latency table uses (impl.bench.stats), measured or simulated. What a
``bidikv bench`` run records is calibration.bench_records (the one JSONL format bench, calibration and
replay share; calibration sits below impl, so it owns the format it fits from); the bench command
itself is sim.bench: it sends the simulator's workloads."""
