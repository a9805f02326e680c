"""Every import of the project's own modules resolves, the ones inside functions included (which
nothing runs until the function does: a benchmark's GPU path, say), so that a moved module or name
fails here on CPU rather than on a GPU machine."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OWN = ("sparse_llm", "benchmarks")
SOURCES = sorted(p for folder in (*OWN, "scripts") for p in (REPO / folder).rglob("*.py"))


def _own_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) of each import of our packages in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(OWN):
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names if alias.name.startswith(OWN)]
    return found


def _resolves(module: str, name: str | None) -> bool:
    try:
        imported = importlib.import_module(module)
    except ImportError:
        return False
    if name is None or name == "*" or hasattr(imported, name):
        return True
    try:  # `from package import submodule`
        importlib.import_module(f"{module}.{name}")
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_own_import_resolves(path):
    broken = [
        f"line {line}: {module}{'' if name is None else ' import ' + name}"
        for line, module, name in _own_imports(path)
        if not _resolves(module, name)
    ]
    assert not broken, broken
