"""What a ``bidikv bench`` run records (impl.bench.records, the one JSONL format bench, calibration
and replay share) and the buckets and percentile every latency table uses (impl.bench.stats). The
bench command itself is sim.bench: it sends the simulator's workloads."""
