"""rayturn.router."""
