"""The tuner: sweep retention and pull-vs-recompute settings in the simulator, measure each against
the clairvoyant oracle and the bidirectional-OFF baseline, and recommend one configuration."""
