"""Measured P5en/EFA numbers, the latency models and their fit; the profiles the simulator runs on.

Start at :mod:`calibration.profile` (the profile the simulator consumes and its equations), then
``calibration/README.md`` (the fit, every figure's error, what cannot be within 3 % and why, and the
leave-one-model-out errors)."""
