"""Parallel plumbing apart from the math and the model: the process groups' lifecycle (world),
shard layouts (sharding, pure), full-shape tensors in and out of shards (full_shape), and
every collective (collectives, one module)."""
