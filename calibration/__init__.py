"""Measured P5en/EFA numbers, the latency models and their fit; the profiles the simulator runs on.

Start at :mod:`calibration.profile` (the profile the simulator consumes and its equations)."""
