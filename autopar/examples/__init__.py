"""Example models and training scripts shipped with autopar."""
