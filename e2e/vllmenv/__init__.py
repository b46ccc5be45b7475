"""vLLM's CPU build in an environment of its own (its torch pin differs from ours)."""
