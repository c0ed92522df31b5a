"""Integrations with training frameworks (optional extras): ``autopar.integrations.lightning`` (``[lightning]``)."""
