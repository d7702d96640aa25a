"""The simulator's command lines as ``bidikv`` registers them: simulate, trace, validate, calibrate
(``bidikv tune`` and ``bidikv bench`` live in sim.tune and sim.bench)."""
