"""torch's APIs on a parallel model: norms, in-place pointwise ops, optimizers, casts, state dicts (DCP)."""
