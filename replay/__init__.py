"""rayturn.replay: recorded agent traces replayed offline and against a cluster."""
