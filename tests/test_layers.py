"""The package's import graph: no cycles, and no module imports a layer above its own.

Layers, lowest first (a module may import its own subpackage and any lower layer):
  0  ops, run_files, metric_keys        kernels' Python front and references (torch alone);
                                        the names in a run directory and of its metrics
  1  config                             the schema (it takes the FFN implementations' names from ops)
  2  model                              the model, built from ops
  3  data, sparsity, analysis           the recipe and the readers, each on its own
  4  inference                          generation and scoring on trained models
  5  eval                               lm-evaluation-harness tasks through the inference path
  6  training                           the train loop (its in-loop task evaluation is eval's)
  7  train, generate (CLIs)
Every import counts, function-level ones included: a deferred import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "sparse_llm"
LAYERS = {
    "ops": 0,
    "run_files": 0,
    "metric_keys": 0,
    "config": 1,
    "model": 2,
    "data": 3,
    "sparsity": 3,
    "analysis": 3,
    "inference": 4,
    "eval": 5,
    "training": 6,
    "train": 7,
    "generate": 7,
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The package modules `path` imports (a `from pkg import sub` of a submodule is that submodule)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name.startswith("sparse_llm"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if not base.startswith("sparse_llm"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in modules else base)
    out.discard(name)
    return {m for m in out if m in modules}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_top_level_part_has_a_layer():
    parts = {_part(m) for m in _modules()} - {""}
    assert parts <= set(LAYERS), f"give these a layer in tests/test_layers.py: {sorted(parts - set(LAYERS))}"


def test_no_module_imports_a_layer_above_or_beside_its_own():
    bad = []
    for module, imported in _graph().items():
        own = _part(module)
        for target in imported:
            other = _part(target)
            if other in ("", own):
                continue
            if LAYERS.get(other, 99) >= LAYERS.get(own, -1):
                bad.append(f"{module} -> {target}")
    assert not bad, "upward or sideways imports:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from sparse_llm.ops.ffn import select", {"sparse_llm.ops.ffn.select"}),
        ("from sparse_llm.ops import ffn", {"sparse_llm.ops.ffn"}),
        ("from sparse_llm.ops import ffn_forward", {"sparse_llm.ops"}),
        ("import sparse_llm.config", {"sparse_llm.config"}),
        ("def f():\n    from sparse_llm.model import llama", {"sparse_llm.model.llama"}),
    ],
)
def test_the_graph_reader_resolves_imports(tmp_path, source, expected):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert _imports(path, "sparse_llm.x", _modules()) == expected


def test_ops_imports_nothing_of_the_package_beyond_itself():
    """`import sparse_llm.ops` works with torch alone: no config schema, no omegaconf or hydra."""
    import subprocess
    import sys

    code = "import sys, sparse_llm.ops; print(sorted(m for m in ('omegaconf', 'hydra', 'sparse_llm.config') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent
    )
    assert out.stdout.strip() == "[]"
