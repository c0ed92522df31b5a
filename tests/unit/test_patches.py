"""autopar.patches and passes.ir.spec_names: every change outside autopar's own objects is undone."""

from __future__ import annotations

import gc

import torch.nn as nn

from autopar import patches
from autopar.compat import fx_builtin_names
from passes.ir import SPEC_TYPES, spec_names


def test_spec_names_are_known_to_fx_only_inside_and_reentrant():
    """Mutation: registering at import (or not undoing) leaves the names in fx's table and fails this."""
    names = {t.__name__ for t in SPEC_TYPES}
    assert not names & fx_builtin_names()
    with spec_names():
        assert names <= fx_builtin_names()
        with spec_names():
            assert names <= fx_builtin_names()
        assert names <= fx_builtin_names()
    assert not names & fx_builtin_names()


def test_model_patches_restore_what_the_instance_had_and_count_live_models():
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    own = lambda x: x  # noqa: E731  (an instance attribute the user set before autopar)
    model.forward = own
    undone = []
    record = patches.of_model(model)
    record.set_attribute("forward", lambda x: 2 * x)
    record.set_attribute("no_sync", object())
    record.add("hooks", lambda: undone.append("hooks"))
    patches.install("probe", lambda: (lambda: undone.append("probe")))
    patches.of_model(other).set_attribute("forward", lambda x: 3 * x)
    patches.release(model)
    assert model.forward is own and "no_sync" not in vars(model) and undone == ["hooks"]
    assert patches.installed("probe")  # another model still lives
    del other
    gc.collect()
    assert undone == ["hooks", "probe"] and not patches.installed("probe")
    assert patches.inventory() == {"process": [], "models": []}
