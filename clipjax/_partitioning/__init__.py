"""The clip of sharded leaves, each device clipping its own shards: `spmd` makes the clip
partitionable by XLA under `jax.jit`, `per_shard` is the clip as one device runs it (its
shards' norms, an all-reduce of a few floats per leaf, the decision, the scale), and
`specs` reads and checks the mesh axes each leaf is split over."""
