"""passes/ stays pure: it imports only torch, networkx, the stdlib and autopar's leaves."""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: autopar.compat is the one home of torch-version differences and private torch names (a leaf: torch only).
ALLOWED_AUTOPAR = {"autopar.compat", "autopar.config", "autopar.decisions", "autopar.errors"}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_passes_import_only_torch_networkx_stdlib_and_leaves():
    for path in sorted((ROOT / "passes").rglob("*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            ok = (top in ("torch", "networkx", "passes", "__future__") or top in sys.stdlib_module_names
                  or name in ALLOWED_AUTOPAR)
            assert ok, f"{path.relative_to(ROOT)} imports {name}"
            assert not name.startswith("torch.distributed"), f"{path.relative_to(ROOT)} imports {name}"


def test_leaves_import_nothing_from_the_project_but_leaves():
    for leaf in ("compat.py", "config.py", "errors.py"):
        names = _imports(ROOT / "autopar" / leaf)
        assert {n for n in names if n.startswith(("autopar", "passes"))} <= ALLOWED_AUTOPAR


def test_no_private_names_are_imported_across_files():
    bad = []
    for top in ("autopar", "passes", "tests", "benchmarks"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in (
                        "autopar", "passes", "tests", "benchmarks"):
                    bad += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_")]
    assert not bad, "private names imported across files:\n" + "\n".join(bad)
