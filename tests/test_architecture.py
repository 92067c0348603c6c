"""The package's shape: layers whose imports point down only, and quick paths that never load torch.

The layer order these tests hold the real imports to is the table in docs/architecture.md.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES

PACKAGE = Path(__file__).resolve().parents[1] / "rbtool"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
MAX_LINES = 800
# Operations on directories: none of them builds on another.
OPERATIONS = {
    "rbtool.ops.checkpoint",
    "rbtool.ops.compare",
    "rbtool.ops.conversion",
    "rbtool.ops.doctor",
    "rbtool.ops.filtering",
    "rbtool.ops.ingestion",
    "rbtool.ops.repair",
    "rbtool.ops.resharding",
    "rbtool.ops.sample",
    "rbtool.ops.stats",
    "rbtool.ops.verify",
}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Package modules `path` imports anywhere (module level or inside functions)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name in known}


def graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Import edges between the package's modules, leaving out its facade (`__init__.py` at the top).

    The facade resolves public names lazily on first use; it is not a layer of its own. A
    sub-package's `__init__` is an edge's target only when something imports the sub-package
    itself (`from rbtool import remote`).
    """
    found = modules(package)
    top = package.name
    edges = {name: imports_of(path, set(found)) - {top} for name, path in found.items()}
    edges.pop(top)
    return {name: {t for t in targets if t != name} for name, targets in edges.items()}


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(edges.get(start, ()))
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(edges.get(name, ()))
    return seen


def layer_order(text: str) -> list[list[str]]:
    """The layers, bottom first, from the architecture page's layer table: each row's packages.

    A row reads `| n | `errors.py`, `progress.py` | owns ... |`; modules are named by path
    (`format/`, `errors.py`).
    """
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            rows.append((int(cells[0]), re.findall(r"`([\w/.]+)`", cells[1])))
    assert [n for n, _ in rows] == list(range(len(rows))), "layer rows numbered 0, 1, 2, ... bottom up"
    return [names for _, names in rows]


def layer_of(module: str, layers: list[list[str]], top: str = "rbtool") -> int:
    """The number of the layer that holds `module` (by its path under the package)."""
    rel = module.removeprefix(top).lstrip(".").replace(".", "/")
    for number, names in enumerate(layers):
        for name in names:
            if name.endswith("/") and (rel + "/").startswith(name):
                return number
            if name.endswith(".py") and rel == name.removesuffix(".py"):
                return number
    raise AssertionError(f"{module}: in no layer of docs/architecture.md")


def upward_imports(edges: dict[str, set[str]], layers: list[list[str]], top: str = "rbtool") -> list[str]:
    """Every import of a module from a layer above its own, as `importer -> imported`."""
    return sorted(
        f"{name} -> {target}"
        for name, targets in edges.items()
        for target in targets
        if layer_of(target, layers, top) > layer_of(name, layers, top)
    )


def test_the_import_graph_has_no_cycle() -> None:
    edges = graph()
    cycles = sorted(name for name in edges if name in reachable(edges, name))
    assert cycles == [], f"modules on an import cycle: {cycles}"


def test_every_module_is_in_one_layer_of_the_architecture_page() -> None:
    layers = layer_order(ARCHITECTURE.read_text())
    named = [name for names in layers for name in names]
    assert len(named) == len(set(named)), "a package named in two layers"
    for name in graph():
        layer_of(name, layers)


def test_imports_point_down_the_layers() -> None:
    """A module imports from its own layer or the ones below it, never from above."""
    layers = layer_order(ARCHITECTURE.read_text())
    assert upward_imports(graph(), layers) == []


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    """The layer check fails on a real upward import: a package whose bottom layer imports its top."""
    package = tmp_path / "pkg"
    for rel, source in {
        "__init__.py": "",
        "errors.py": "",
        "files/__init__.py": "",
        "files/index.py": "from pkg.errors import x\n",
        "ops/__init__.py": "",
        "ops/stats.py": "from pkg.files.index import Index\n",
        "files/dirs.py": "def f():\n    from pkg.ops import stats\n",
    }.items():
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_text(source)
    layers = layer_order("## Layers\n| 0 | `errors.py` |\n| 1 | `files/` |\n| 2 | `ops/` |\n")
    assert upward_imports(graph(package), layers, "pkg") == [
        "pkg.files.dirs -> pkg.ops",
        "pkg.files.dirs -> pkg.ops.stats",
    ]
    edges = graph(package)
    edges["pkg.files.dirs"] -= {"pkg.ops", "pkg.ops.stats"}
    assert upward_imports(edges, layers, "pkg") == []
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("pkg.viewer.app", layers, "pkg")


def test_no_module_is_over_the_line_limit() -> None:
    long = {
        name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"modules over {MAX_LINES} lines: {long}"


def test_checkpoint_does_not_import_the_buffer() -> None:
    assert "rbtool.buffer.replay" not in reachable(graph(), "rbtool.ops.checkpoint")


def test_no_operation_imports_another() -> None:
    edges = graph()
    for operation in OPERATIONS:
        assert not (reachable(edges, operation) & (OPERATIONS - {operation})), operation


def test_the_library_never_imports_the_command_line() -> None:
    edges = graph()
    for name in edges:
        if not name.startswith("rbtool.cli") and name != "rbtool.__main__":
            assert not any(t.startswith("rbtool.cli") for t in reachable(edges, name)), name


def test_the_format_layer_stands_on_the_base_alone() -> None:
    """format and errors are the bottom: what may be in a checkpoint, with no I/O layer under it."""
    edges = graph()
    assert reachable(edges, "rbtool.errors") == set()
    for name in edges:
        if name.startswith("rbtool.format"):
            below = {t for t in reachable(edges, name) if not t.startswith("rbtool.format")}
            assert below <= {"rbtool.errors", "rbtool.progress"}, name


@pytest.mark.parametrize(
    "argv",
    [
        ["verify", str(FIXTURES / "autosave_pt" / "autosave")],
        ["verify", str(FIXTURES / "ranks")],
        ["stats", str(FIXTURES / "autosave_pt" / "autosave"), "--index-only"],
        ["stats", str(FIXTURES / "varying_shapes_pt" / "ckpt"), "--index-only", "--json"],
        ["checkpoint", "load", str(FIXTURES / "ranks" / "rank_1"), "--world-size", "2", "--json"],
        ["checkpoint", "load", str(FIXTURES / "ranks"), "--world-size", "3", "--json"],
        ["stats", str(FIXTURES / "ranks"), "--index-only", "--json"],
        ["reshard", str(FIXTURES / "ranks"), "--world-size", "3", "--out", "/nonexistent/x", "--dry-run"],
        ["filter", str(FIXTURES / "ranks"), "--out", "/nonexistent/x", "--last", "2", "--dry-run"],
        ["--help"],
    ],
    ids=[
        "verify",
        "verify-ranks",
        "stats-index-only",
        "stats-index-only-json",
        "checkpoint-load",
        "checkpoint-load-ranks",
        "stats-index-only-ranks",
        "reshard-dry-run",
        "filter-dry-run",
        "help",
    ],
)
def test_quick_commands_import_no_torch(argv: list[str]) -> None:
    code = (
        "import sys\n"
        "from rbtool.cli import app\n"
        "try:\n"
        f"    app({argv!r})\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        "print('\\nTORCH' if 'torch' in sys.modules else '\\nNO-TORCH', code, file=sys.stderr)\n"
    )
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    last = probe.stderr.strip().splitlines()[-1]
    assert last == "NO-TORCH 0", probe.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["verify", str(FIXTURES / "autosave_pt" / "autosave"), "--deep"],
        ["stats", str(FIXTURES / "ranks"), "--index-only"],
        ["checkpoint", "load", "file://" + str(FIXTURES / "ranks"), "--world-size", "2"],
        ["reshard", str(FIXTURES / "ranks"), "--world-size", "3", "--out", "/nonexistent/x", "--dry-run"],
    ],
    ids=["verify-deep", "stats-index-only", "checkpoint-load-file-url", "reshard-dry-run"],
)
def test_local_paths_never_import_fsspec(argv: list[str]) -> None:
    """fsspec (an optional extra) is for URLs: commands on local paths, file:// included, never load it."""
    code = (
        "import sys\n"
        "from rbtool.cli import app\n"
        "try:\n"
        f"    app({argv!r})\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        "print('\\nFSSPEC' if 'fsspec' in sys.modules else '\\nNO-FSSPEC', code, file=sys.stderr)\n"
    )
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    last = probe.stderr.strip().splitlines()[-1]
    assert last == "NO-FSSPEC 0", probe.stderr
