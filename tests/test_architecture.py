"""The package's shape: imports point down only, and the quick paths never load torch.

The module map these tests keep honest is docs/architecture.md.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES

PACKAGE = Path(__file__).resolve().parents[1] / "rbtool"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
# Operations on directories: none of them builds on another.
OPERATIONS = {
    "rbtool.ops.checkpoint",
    "rbtool.ops.compare",
    "rbtool.ops.conversion",
    "rbtool.ops.filtering",
    "rbtool.ops.ingestion",
    "rbtool.interop.lerobot",
    "rbtool.ops.repair",
    "rbtool.ops.resharding",
    "rbtool.ops.stats",
    "rbtool.ops.verify",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """rbtool modules `path` imports anywhere (module level or inside functions)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name in known}


def graph() -> dict[str, set[str]]:
    """Import edges between rbtool modules, leaving out the package facade (rbtool/__init__.py).

    The facade resolves public names lazily on first use; it is not a layer of its own.
    """
    known = set(modules())
    edges = {name: imports_of(path, known) - {"rbtool"} for name, path in modules().items()}
    edges.pop("rbtool")
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


def test_the_import_graph_has_no_cycle() -> None:
    edges = graph()
    cycles = sorted(name for name in edges if name in reachable(edges, name))
    assert cycles == [], f"modules on an import cycle: {cycles}"


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


def test_the_format_layer_stands_on_errors_alone() -> None:
    """format and errors are the bottom: what may be in a checkpoint, with no I/O layer under it."""
    edges = graph()
    assert reachable(edges, "rbtool.errors") == set()
    outside = {name for name in reachable(edges, "rbtool.format") if not name.startswith("rbtool.format.")}
    assert outside == {"rbtool.errors"}


def test_every_module_is_in_the_architecture_page() -> None:
    text = ARCHITECTURE.read_text()
    for name in modules():
        if name not in ("rbtool", "rbtool.__main__") and not name.startswith("rbtool.cli."):
            assert f"`{name.removeprefix('rbtool.')}`" in text or f"`{name}`" in text, name


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
