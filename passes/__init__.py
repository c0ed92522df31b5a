"""autopar's graph passes and analyses: pure functions over torch.fx graphs.

Imports only torch, torch.fx, networkx and autopar's leaves (autopar.config, autopar.decisions,
autopar.errors); never process groups, ranks or environment variables. Every pass runs in a plain single-process pytest.
"""
