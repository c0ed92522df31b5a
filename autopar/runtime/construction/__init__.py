"""Deferred construction: a model built inside ``auto_parallelize`` recorded on meta, replayed a tensor at a time."""
