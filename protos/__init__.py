"""rayturn.protos."""
