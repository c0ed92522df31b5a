"""Data parallelism: gradient sync, per-rank batches."""
