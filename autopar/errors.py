"""Errors raised by autopar. Leaf module: imports nothing from the project.

Every message says what is wrong, with the values involved, and how to fix it.
"""

from __future__ import annotations


class AutoparError(Exception):
    """Base class of every error autopar raises for a user mistake or an unsupported model."""


class ConfigError(AutoparError, ValueError):
    """The parallel configuration is invalid (bad degrees, world size mismatch, bad options)."""


class NotInitializedError(AutoparError, RuntimeError):
    """torch.distributed is needed but no default process group exists."""


class ContextError(AutoparError, RuntimeError):
    """auto_parallelize was used wrongly (nested, or the model was not built inside it)."""


class CaptureError(AutoparError, RuntimeError):
    """The model could not be captured as a graph, or the capture is unusable."""


class PlanError(AutoparError, RuntimeError):
    """autopar cannot plan or apply a sharding for this graph."""


class InputError(AutoparError, ValueError):
    """A call's inputs do not fit the parallel model (batch too small, mismatched batch dims)."""


class CheckpointError(AutoparError, RuntimeError):
    """A checkpoint would lose or mix up shards (e.g. one rank pickling its shards)."""


class ParameterError(AutoparError, RuntimeError):
    """A sharded parameter was used in a way this rank cannot serve (e.g. another pipeline stage's)."""


class AgreementError(AutoparError, RuntimeError):
    """The ranks called a parallel model differently (evaluation on one rank only, other inputs)."""


class RanksPartedError(AgreementError):
    """The ranks stopped making the same calls (one raised and went on, stalled, or made a call the others did
    not): a collective failed, and the message names each rank and what it was doing."""


class StateDictError(AutoparError, KeyError):
    """A state dict does not match the model (missing or unexpected keys, wrong shapes)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""
