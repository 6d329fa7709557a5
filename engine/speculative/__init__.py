"""Speculative decoding: drafts proposed cheaply, verified in one forward (greedy, exact)."""
