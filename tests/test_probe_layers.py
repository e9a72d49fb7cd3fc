"""The probe core is layered one way: targets < metrics < tasks < heads < train.

Each module may import only the layers below it (and the leaf helpers ``bootstrap`` and
``sinkhorn``, the builder's ``schema`` and the ``spar_bench`` core), never a run-level module
(``fit``, ``runs``, ``finetune``, ``vqa``, ``sweep``, ``ensemble``, ``cache`` ...). Imports
inside functions count; ``if TYPE_CHECKING:`` imports (annotations only) do not. Parsed with
:mod:`ast`, nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PROBES = Path(__file__).resolve().parents[1] / "probes"
#: lowest first; a module may import the ones before it
LAYERS = ("targets", "metrics", "tasks", "heads", "train")
LEAVES = {"bootstrap", "sinkhorn"}


def probe_imports(source: str, package: str) -> set[str]:
    """The ``spar_bench.probes`` modules ``source`` imports (first component after
    ``probes.``), outside ``if TYPE_CHECKING:``. ``package`` is the module's own package
    (``"probes"`` or ``"probes.heads"``), for relative imports."""
    found: set[str] = set()

    def add(dotted: str) -> None:
        parts = dotted.split(".")
        if parts[:2] == ["spar_bench", "probes"] and len(parts) > 2:
            found.add(parts[2])

    def visit(node: ast.AST) -> None:
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in (
            getattr(test, "id", ""),
            getattr(test, "attr", ""),
        ):
            for stmt in node.orelse:
                visit(stmt)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = ["spar_bench", *package.split(".")]
                base = parts[: len(parts) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
                names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
            for name in names:
                add(name)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def test_the_parser_sees_lazy_imports_and_skips_type_checking() -> None:
    src = ("from typing import TYPE_CHECKING\nfrom .targets import Targets\n"
           "if TYPE_CHECKING:\n    from .fit import X\n"
           "def f():\n    from spar_bench.probes.runs import spec\n    from . import sweep\n"
           "    from ..tasks import get_probe\n")  # fmt: skip
    assert probe_imports(src, "probes") == {"targets", "runs", "sweep"}
    assert probe_imports(src, "probes.heads") == {"heads", "runs", "tasks"}


def _files(layer: str) -> list[tuple[Path, str]]:
    folder = PROBES / layer
    if folder.is_dir():
        return [(p, f"probes.{layer}") for p in sorted(folder.glob("*.py"))]
    return [(PROBES / f"{layer}.py", "probes")]


@pytest.mark.parametrize("layer", LAYERS)
def test_probe_core_imports_only_lower_layers(layer: str) -> None:
    allowed = set(LAYERS[: LAYERS.index(layer)]) | LEAVES | {layer}
    for path, package in _files(layer):
        bad = probe_imports(path.read_text(encoding="utf-8"), package) - allowed
        assert not bad, (
            f"{path.relative_to(PROBES.parent)} imports {sorted(bad)}; allowed: {sorted(allowed)}"
        )
