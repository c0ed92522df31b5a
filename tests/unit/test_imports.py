"""passes/ stays pure (only torch, networkx, the stdlib and autopar's leaves); autopar/runtime/'s folders import only
downward, in no circle, and the README names each."""

import ast
import re
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


#: autopar/runtime/'s folders, lowest first: a folder imports only from folders on lower levels (and its own).
#: comm and construction need nothing of the runtime; the hub (parallel_runtime.py) ties them all.
RUNTIME_LEVELS = {"comm": 0, "construction": 0, "ops": 1, "params": 2, "data_parallel": 3, "pipeline": 3,
                  "interop": 3, "compiled": 3, "execution": 4, "parallel_runtime": 5}


def _runtime_imports() -> dict[str, set[str]]:
    """Each runtime module (dotted, under autopar.runtime) and the runtime modules it imports, at any depth of
    its code (``if TYPE_CHECKING:`` and imports inside functions count: a circle through them is still one)."""
    out = {}
    root = ROOT / "autopar" / "runtime"
    for path in sorted(root.rglob("*.py")):
        mod = ".".join(path.relative_to(root).with_suffix("").parts)
        if mod.endswith("__init__"):
            continue
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("autopar.runtime."):
                base = node.module.removeprefix("autopar.runtime.")
                package = (root / base.replace(".", "/")).is_dir()
                names.update(f"{base}.{a.name}" for a in node.names) if package else names.add(base)
        out[mod] = names
    return out


def test_runtime_folders_import_only_downward():
    """Every runtime module lives in a folder named in RUNTIME_LEVELS (or is the hub), and imports only from its
    own folder or a lower level. Mutation: ops/matmul importing execution.kept_state (as it did): fails."""
    bad = []
    for mod, names in _runtime_imports().items():
        room = mod.split(".")[0]
        assert room in RUNTIME_LEVELS, f"autopar/runtime/{mod} is in no folder of RUNTIME_LEVELS"
        for name in names:
            other = name.split(".")[0]
            if other != room and RUNTIME_LEVELS.get(other, 99) >= RUNTIME_LEVELS[room]:
                bad.append(f"{mod} -> {name}")
    assert not bad, "runtime imports pointing up or sideways:\n" + "\n".join(bad)


def test_runtime_modules_import_in_no_circle():
    """No circle among the runtime's modules (ops <-> tokens was one: the sequence-parallel matmul now lives
    with the matmuls)."""
    imports = _runtime_imports()
    graph = {m: {n for n in names if n in imports} for m, names in imports.items()}
    done, stack = set(), []

    def visit(m: str) -> None:
        if m in stack:
            raise AssertionError("import circle: " + " -> ".join(stack[stack.index(m):] + [m]))
        if m in done:
            return
        stack.append(m)
        for n in sorted(graph[m]):
            visit(n)
        stack.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def test_the_readme_names_every_runtime_folder():
    """The README's layout has a line for every folder of autopar/runtime/ (and for the planning path), and names
    no folder that is gone."""
    layout = (ROOT / "README.md").read_text().split("\n## Layout", 1)[1]
    folders = {p.name for p in (ROOT / "autopar" / "runtime").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(RUNTIME_LEVELS) - {"parallel_runtime"}
    for f in sorted(folders):
        assert f"`autopar/runtime/{f}/`" in layout, f"README's layout misses autopar/runtime/{f}/"
    named = set(re.findall(r"`autopar/runtime/(\w+)/`", layout))
    assert named <= folders, f"README's layout names folders that are gone: {sorted(named - folders)}"
    assert "`autopar/planning/`" in layout and "`autopar/runtime/parallel_runtime.py`" in layout
