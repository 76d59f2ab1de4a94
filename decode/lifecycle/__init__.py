"""The session KV life cycle on a decode replica: where each session's pages live between its calls."""
