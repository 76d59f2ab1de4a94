"""rayturn.cluster."""
