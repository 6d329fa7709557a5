"""Speculative decoding: drafts proposed cheaply, verified in one forward (exact: greedy and sampled)."""
