"""rayturn.kvstore."""
