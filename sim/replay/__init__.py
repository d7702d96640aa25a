"""Measured runs replayed through the simulator: the published benchmark (calibration's simulated
column) and a recorded ``bidikv bench`` run (``bidikv validate``)."""
