"""A call of a parallel model: its check across ranks, the executable builder, binding, the graph cache, the
state kept split between calls, uncaptured calls."""
