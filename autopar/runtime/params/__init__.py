"""Parameters on this rank: the store, their layout as DTensors, pieces held elsewhere, data shards."""
