"""Every torch-version difference and private torch name lives in autopar/compat.py.

Two checks keep it so: no other source file names a private torch module or attribute (walked with
``ast``), and every module of autopar/ and passes/ imports on the torch running the test (CI runs this file
on the newest torch and on the floor, 2.11: a shim missing for either fails here).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch

from autopar import compat

ROOT = Path(__file__).resolve().parents[2]
#: Private attributes of torch objects (DTensor's state, autograd's engine, fx, tensor internals) that
#: code reaches through a variable, so the chain does not start with ``torch``.
PRIVATE_ATTRS = {"_local_tensor", "_spec", "_execution_engine", "_op_dispatcher", "_custom_op_handlers",
                 "_select_split_tensor", "_cdata", "_version", "_register_custom_builtin",
                 "_make_wrapper_subclass", "_disabled_torch_function_impl", "_resolve_process_group", "_schema",
                 "_backward_hooks", "_post_accumulate_grad_hooks", "_parameters", "_buffers", "_flatten"}
#: Underscored torch functions that are documented for model code (``torch._check`` in export's guide, the
#: ``torch._foreach_*`` ops optimizers and clipping use): tests call them the way users' models do.
USER_FACING = ("torch._check", "torch._foreach_")


def _sources() -> list[Path]:
    return [p for top in ("autopar", "passes", "benchmarks", "tests") for p in sorted((ROOT / top).rglob("*.py"))
            if p not in (ROOT / "autopar" / "compat.py", Path(__file__).resolve())]


def _dotted(node: ast.AST) -> list[str]:
    """``a.b.c`` -> ["a", "b", "c"]; [] when the chain does not start with a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else []


def private_torch_uses(source: str) -> list[str]:
    """The private torch names ``source`` uses: imports of ``torch.*._x`` modules or names, attribute
    chains from ``torch`` through a ``_x`` (except ``torch.ops``: ``aten._to_copy`` is an op's name), the
    attributes in PRIVATE_ATTRS on anything, and getattr of one of them by string."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names
                      if a.name.split(".")[0] == "torch" and any(s.startswith("_") for s in a.name.split("."))]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            parts = node.module.split(".")
            found += [f"{node.module}.{a.name}" for a in node.names
                      if any(s.startswith("_") for s in parts) or a.name.startswith("_")]
        elif isinstance(node, ast.Attribute):
            chain = _dotted(node)
            if chain[:1] == ["torch"] and chain[1:2] != ["ops"] and not ".".join(chain).startswith(USER_FACING) and any(
                    s.startswith("_") and not s.startswith("__") for s in chain[1:]):
                found.append(".".join(chain))
            elif node.attr in PRIVATE_ATTRS:
                found.append(f"._{node.attr.lstrip('_')}")
        elif isinstance(node, ast.Constant) and node.value in PRIVATE_ATTRS:  # getattr(p, "_x"), a table of names
            found.append(repr(node.value))
    return sorted(set(found))


#: Private torch attributes two tests read on purpose: they check torch's own schedule order against the
#: planner's model of it, so they change with torch whatever we do.
TORCH_INTERNALS_UNDER_TEST = {"tests/unit/test_schedule_order.py": {"_step_microbatches"},
                              "tests/unit/test_search_plans.py": {"_calculate_single_rank_operations"}}
#: Underscored names that are not torch's private Python names: aten/prims op names (``aten._to_copy``),
#: ``os._exit``, and hooks user models in tests register the way HF models do.
NOT_PRIVATE_PARENTS = {"aten", "prims", "ops", "os", "torch"}  # (torch.x: the first scan)
USER_MODEL_HOOKS = {"_register_state_dict_hook", "_register_load_state_dict_pre_hook"}


def foreign_private_attributes(paths: list[Path]) -> dict[str, set[str]]:
    """``x._name`` reads whose ``_name`` the project never defines (a def, class, assignment or argument):
    someone else's private attribute, so torch's."""
    defined: set[str] = set()
    used: dict[str, set[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defined.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                defined.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                parent = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
                if parent not in NOT_PRIVATE_PARENTS and node.attr not in USER_MODEL_HOOKS:
                    used.setdefault(str(path.relative_to(ROOT)), set()).add(node.attr)
    out = {}
    for path, names in used.items():
        foreign = names - defined - TORCH_INTERNALS_UNDER_TEST.get(path, set())
        if foreign:
            out[path] = foreign
    return out


def test_private_torch_names_only_in_compat():
    bad = {str(p.relative_to(ROOT)): uses for p in _sources() if (uses := private_torch_uses(p.read_text()))}
    assert not bad, f"private torch names outside autopar/compat.py: {bad}"
    foreign = foreign_private_attributes(_sources())
    assert not foreign, f"private attributes of torch objects outside autopar/compat.py: {foreign}"


def test_the_scan_finds_each_kind_of_private_use():
    # the mutation check of the test above: each spelling it must catch
    for source in ("import torch.utils._pytree as pytree", "from torch._ops import OpOverload",
                   "from torch.distributed.tensor.placement_types import _StridedShard",
                   "x = torch._C._disabled_torch_function_impl", "torch.autograd.Variable._execution_engine.q(f)",
                   "y = p._local_tensor", "p._spec = s", "getattr(p, '_local_tensor', None)",
                   "TABLES = ('_backward_hooks',)"):
        assert private_torch_uses(source), source
    assert not private_torch_uses("torch.ops.aten._to_copy.default\nx.__class__\nself._cache")
    tmp = ROOT / "tests" / "unit" / "_scan_probe.py"
    try:  # a private attribute read through a variable, which only the second scan sees
        tmp.write_text("def f(mesh):\n    return mesh._flatten('batch'), aten._to_copy, self_made()._mine\n"
                       "class A:\n    _mine = 1\n")
        assert foreign_private_attributes([tmp]) == {"tests/unit/_scan_probe.py": {"_flatten"}}
    finally:
        tmp.unlink()


def _modules() -> list[str]:
    out = []
    for top in ("autopar", "passes"):
        for p in sorted((ROOT / top).rglob("*.py")):
            parts = p.relative_to(ROOT).with_suffix("").parts
            out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


#: The optional extras (setup.cfg): a module that needs one is skipped where it is not installed.
OPTIONAL = {"lightning", "litgpt", "transformers", "matplotlib", "tqdm"}


@pytest.mark.parametrize("name", _modules())
def test_every_module_imports_on_this_torch(name):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in OPTIONAL:
            raise
        pytest.skip(f"{name} needs the optional {e.name}")


def test_shims_answer_on_this_torch():
    x = torch.zeros(3)
    v = compat.version_of(x)
    x.add_(1)
    assert compat.version_of(x) == v + 1
    assert compat.size_hint(5) == 5
    assert compat.storage_key(x) == compat.storage_key(x[1:])
    assert callable(compat.all_gather_into) and callable(compat.reduce_scatter_into)
    assert isinstance(compat.dtensor_op_handlers(), dict)


def test_collective_launches_reads_each_form_inductor_writes_and_bucketing_is_capped():
    class Compiled:  # the lines of Inductor's generated code that launch collectives, in their several forms
        source_code = "\n".join([
            "torch.ops._c10d_functional.all_reduce_.default(buf1, 'sum', '0')",
            "buf2 = torch.ops._c10d_functional.all_gather_into_tensor.default(buf0, 4, '0')",
            "torch.ops._c10d_functional.all_gather_into_tensor_out.default(buf3, 4, '0', out=buf4)",
            "buf5 = torch.ops._c10d_functional.reduce_scatter_tensor.default(buf4, 'sum', 4, '0')",
            "torch.ops._c10d_functional.wait_tensor.default(buf5)"])

    assert compat.collective_launches(Compiled()) == {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 1}
    assert compat.collective_launches(object()) is None
    options = compat.inductor_bucketing_options(25 * 2**20)
    if options:  # this torch has the passes: a bucket holds 25 MiB, not torch's default 2 GB
        assert options["bucket_all_gathers_fx"] == options["bucket_reduce_scatters_fx"] == "all"
        assert options["bucket_all_gathers_fx_bucket_size_determinator"](0) == 25.0
        assert options["bucket_reduce_scatters_fx_bucket_size_determinator"](7) == 25.0


def test_dispatch_modes_set_aside_and_entered_again_and_the_tracing_ones_named():
    """A FLOP counter is a user's mode: set aside (none active), entered again (its ops counted, as they are
    around autopar's compiled code), then back as it was. A fake-tensor mode under it is a tracing one."""
    from torch.utils.flop_counter import FlopCounterMode

    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with FlopCounterMode(display=False) as counter:
        assert compat.dispatch_mode_active() is not None and not compat.tracing_modes_active()
        with compat.dispatch_modes_set_aside() as modes:
            assert compat.dispatch_mode_active() is None and len(modes) == 1
            a @ b  # not counted
            with compat.dispatch_modes_entered(modes):
                a @ b  # counted
            assert compat.dispatch_mode_active() is None
        assert compat.dispatch_mode_active() is not None
    assert counter.get_total_flops() == 2 * 4 * 4 * 4
    with compat.FakeTensorMode(), FlopCounterMode(display=False):
        assert compat.tracing_modes_active()
