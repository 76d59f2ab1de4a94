"""rayturn.decode."""
