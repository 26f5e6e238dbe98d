"""Parallel plumbing apart from the math: sharding layouts (pure) and collectives (one module)."""
