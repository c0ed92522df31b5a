"""The per-rank runtime: process groups, counted collectives, the sharded ops an emitted graph calls,
parameters, gradient sync, pipeline stages, and the runtime that binds them for one model.

Nothing here decides anything: ``passes`` plans, this package carries the plan out on this rank.
"""
