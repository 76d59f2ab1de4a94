"""rayturn.prefill."""
