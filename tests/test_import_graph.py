"""The import graph of ``spar_bench``: no cycle, no private name imported across modules, and
a core that stands on nothing above it.

Every module is parsed with :mod:`ast` (nothing is imported). The folders come from setup.cfg's
``package_dir`` (``spar_bench/``, ``builder/``, ``probes/``, ``manifests/``, ``experiments/``
today; a folder mapped there later is covered at once), and they are one import package:
``builder/x.py`` is ``spar_bench.builder.x``. Every import statement counts, wherever it
stands (module level, inside a function, a ``try`` or an ``if``): a lazy import inside a
function still ties the two modules together. ``importlib.import_module`` with a computed
name is not seen.

**Edges.** ``import a.b.c`` (with or without ``as``) is an edge to ``a.b.c``.
``from P import n`` is an edge to ``P.n`` when that is a module of the package (a submodule
import, ``from . import fit`` included), else to ``P`` itself (a name taken from ``P``; for a
package, from its ``__init__``). Importing a module also initialises its parent packages, but
that is no edge: a parent's ``__init__`` is always entered before its submodules, so a package
``__init__`` that imports (re-exports) its own submodules is not a cycle with them. A real
cycle is one where the submodule needs the ``__init__`` back: ``from P import name`` inside
``P.sub`` while ``P/__init__`` imports ``P.sub`` is an edge each way, and reported.

**TYPE_CHECKING.** Imports under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) never run,
so they are left out of the cycle check (annotation-only cycles are harmless with
``from __future__ import annotations``). They still count for the private-name check.

**Cycles** are reported as elementary chains ``a -> b -> a`` (the ``spar_bench.`` prefix left
out), each rotated to start at its smallest module, so one entry names one cycle whatever
module the search started from.

**The core.** ``spar_bench/`` (the modules of ``spar_bench`` that no other folder maps) is the
ground floor: it imports nothing from the folders mapped onto it (``builder/``, ``probes/``,
``experiments/`` ...), TYPE_CHECKING imports included. Entries read ``importer -> imported``.

**Private names.** A violation is a name starting with ``_`` (dunders such as ``__version__``
are fine) taken from another module of the package: ``from .x import _name``,
``from spar_bench.y import _name``, or ``mod._name`` where ``mod`` is bound to a module of the
package by an import (``import spar_bench.probes.train as train``, ``from . import fit``,
``from .finetune import run as run_mod``). A private *module* (``_impl.py``) is private to its
package: imported from outside that package it is a violation too. Entries read
``importer: module._name``. Names bound to modules are tracked per file, not per scope. Not
checked: private attributes of objects (``enc._layer_tokens``) and private names of other
distributions (``compat.py`` exists for those).

The allowlists hold today's violations (issue 22: they must shrink to empty). The checks
fail on a new violation, and on an allowlist entry that no longer occurs (delete it).
"""

from __future__ import annotations

import ast
import configparser
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: the command-line layers: parsers of argv into library calls, which no library module calls
CLI_MODULES = ("spar_bench.probes.cli", "spar_bench.builder.cli", "spar_bench.builder.phantom.cli")
PREFIX = "spar_bench."
CORE = "spar_bench"


def setup_options(root: Path) -> configparser.SectionProxy:
    cfg = configparser.ConfigParser()
    cfg.read(root / "setup.cfg", encoding="utf-8")
    return cfg["options"]


def _lines(value: str) -> list[str]:
    return [x.strip() for x in value.splitlines() if x.strip() and not x.strip().startswith("#")]


def package_dirs(root: Path) -> dict[str, str]:
    """folder -> import package, from setup.cfg ``[options] package_dir`` (``package = folder``)."""
    pairs = (line.split("=", 1) for line in _lines(setup_options(root)["package_dir"]))
    return {folder.strip(): package.strip() for package, folder in pairs}


def installed_packages(root: Path) -> list[str]:
    """setup.cfg ``[options] packages``: every package the wheel installs."""
    return _lines(setup_options(root)["packages"])


PACKAGE_DIRS = package_dirs(REPO)

# issue 22: must shrink to empty. Delete an entry when its cycle is gone (the stale test says which).
KNOWN_CYCLES: set[str] = set()

# issue 22: must shrink to empty. Delete an entry when its import is gone (the stale test says which).
KNOWN_PRIVATE: set[str] = set()


# -- the checker ------------------------------------------------------------------------
@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    #: imported module -> first line; the TYPE_CHECKING-only ones are in `typing_only`
    imports: dict[str, int] = field(default_factory=dict)
    typing_only: dict[str, int] = field(default_factory=dict)
    #: "module._name" -> first line
    private: dict[str, int] = field(default_factory=dict)


def short(name: str) -> str:
    return name[len(PREFIX):] if name.startswith(PREFIX) else name


def discover(root: Path, package_dirs: dict[str, str]) -> dict[str, Module]:
    """Every ``.py`` file under the mapped folders, by dotted module name."""
    mods: dict[str, Module] = {}
    for folder, package in package_dirs.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("").parts
            if not (base / Path(*rel[:-1]) / "__init__.py").is_file() and len(rel) > 1:
                continue  # not inside a package (e.g. a stray script folder)
            is_package = rel[-1] == "__init__"
            parts = [package, *rel[:-1]] if is_package else [package, *rel]
            name = ".".join(parts)
            mods[name] = Module(name, path, is_package)
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class _Visitor(ast.NodeVisitor):
    """Collect one module's imports, module bindings and private-name uses."""

    def __init__(self, mod: Module, mods: dict[str, Module]):
        self.mod, self.mods = mod, mods
        self.typing_depth = 0
        self.bound: dict[str, set[str]] = {}  # local name -> modules it is bound to
        self.attributes: list[ast.Attribute] = []

    # where a relative import points
    def _base(self, module: str | None, level: int) -> str:
        if level == 0:
            return module or ""
        parts = self.mod.name.split(".")
        keep = len(parts) - (level - 1 if self.mod.is_package else level)
        base = ".".join(parts[:keep])
        return f"{base}.{module}" if module else base

    def _edge(self, target: str, line: int) -> None:
        if target not in self.mods or target == self.mod.name:
            return
        into = self.mod.typing_only if self.typing_depth else self.mod.imports
        into.setdefault(target, line)

    def _private_use(self, entry: str, line: int) -> None:
        self.mod.private.setdefault(entry, line)

    def _private_module(self, target: str) -> bool:
        """``target`` is a private module of a package other than this module's."""
        parent, _, last = target.rpartition(".")
        mine = self.mod.name if self.mod.is_package else self.mod.name.rpartition(".")[0]
        return _private(last) and not (mine == parent or mine.startswith(parent + "."))

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self.typing_depth += 1
            for stmt in node.body:
                self.visit(stmt)
            self.typing_depth -= 1
            for stmt in node.orelse:
                self.visit(stmt)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if not alias.name.startswith("spar_bench"):
                continue
            self._edge(alias.name, node.lineno)
            if self._private_module(alias.name):
                self._private_use(short(alias.name), node.lineno)
            if alias.asname:
                self.bound.setdefault(alias.asname, set()).add(alias.name)
            else:  # `import spar_bench.x.y` binds `spar_bench`
                self.bound.setdefault(alias.name.split(".")[0], set()).add("spar_bench")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._base(node.module, node.level)
        if base not in self.mods:
            return
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in self.mods:  # a submodule
                self._edge(sub, node.lineno)
                self.bound.setdefault(alias.asname or alias.name, set()).add(sub)
                if self._private_module(sub):
                    self._private_use(short(sub), node.lineno)
            else:
                self._edge(base, node.lineno)
                if _private(alias.name):
                    self._private_use(f"{short(base)}.{alias.name}", node.lineno)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.attributes.append(node)
        self.generic_visit(node)

    def check_attributes(self) -> None:
        """``mod._name`` for every attribute chain rooted at a name bound to a module."""
        for node in self.attributes:
            chain: list[str] = []
            cur: ast.expr = node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if not isinstance(cur, ast.Name) or cur.id not in self.bound:
                continue
            chain.reverse()
            for start in self.bound[cur.id]:
                self._check_chain(start, chain, node.lineno)

    def _check_chain(self, module: str, chain: list[str], line: int) -> None:
        for attr in chain:
            if f"{module}.{attr}" in self.mods:
                module = f"{module}.{attr}"
                continue
            if _private(attr) and module != self.mod.name:
                self._private_use(f"{short(module)}.{attr}", line)
            return


def scan(root: Path, package_dirs: dict[str, str] = PACKAGE_DIRS) -> dict[str, Module]:
    mods = discover(root, package_dirs)
    for mod in mods.values():
        visitor = _Visitor(mod, mods)
        visitor.visit(ast.parse(mod.path.read_text(encoding="utf-8"), str(mod.path)))
        visitor.check_attributes()
    return mods


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _simple_cycles(graph: dict[str, set[str]], comp: list[str], limit: int = 200) -> list[list[str]]:
    """Elementary cycles inside one component, each starting at its smallest module."""
    members = set(comp)
    cycles: list[list[str]] = []
    for i, start in enumerate(comp):  # cycles whose smallest module is `start`
        allowed = set(comp[i:])
        path, stack = [start], [iter(sorted(graph[start] & allowed))]
        while stack and len(cycles) < limit:
            w = next(stack[-1], None)
            if w is None:
                stack.pop()
                path.pop()
            elif w == start:
                cycles.append([*path, start])
            elif w not in path and w in members:
                path.append(w)
                stack.append(iter(sorted(graph[w] & allowed)))
    return cycles


def find_cycles(mods: dict[str, Module]) -> set[str]:
    """Every elementary import cycle (TYPE_CHECKING-only imports left out), as ``a -> b -> a``."""
    graph = {name: set(mod.imports) for name, mod in mods.items()}
    found = set()
    for comp in _components(graph):
        for cycle in _simple_cycles(graph, comp):
            found.add(" -> ".join(short(m) for m in cycle))
    return found


def find_private(mods: dict[str, Module]) -> set[str]:
    """Every private name taken from another module, as ``importer: module._name``."""
    return {f"{short(name)}: {entry}" for name, mod in mods.items() for entry in mod.private}


def find_core_imports(mods: dict[str, Module], package_dirs: dict[str, str] = PACKAGE_DIRS) -> set[str]:
    """Every import of the core (``spar_bench`` less the packages mapped onto it) into a mapped
    package, TYPE_CHECKING ones included, as ``importer -> imported``."""
    mapped = [p for p in package_dirs.values() if p != CORE]

    def above(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in mapped)

    return {f"{short(name)} -> {short(target)}" for name, mod in mods.items() if not above(name)
            for target in sorted({*mod.imports, *mod.typing_only}) if above(target)}


def _where(mods: dict[str, Module], entry: str) -> str:
    importer, _, used = entry.partition(": ")
    mod = mods[PREFIX + importer if PREFIX + importer in mods else importer]
    return f"{mod.path.relative_to(REPO) if mod.path.is_relative_to(REPO) else mod.path}:{mod.private[used]}"


# -- the checks on the package -----------------------------------------------------------
@pytest.fixture(scope="module")
def package() -> dict[str, Module]:
    mods = scan(REPO)
    assert len(mods) > 50 and "spar_bench.builder.schema" in mods  # the mapping found the package
    return mods


def test_no_new_import_cycle(package):
    found = find_cycles(package)
    new = sorted(found - KNOWN_CYCLES)
    for cycle in sorted(KNOWN_CYCLES - found):
        print(f"fixed (delete from KNOWN_CYCLES): {cycle}")
    assert not new, "import cycles (break them; see the docstring for the rule):\n" + "\n".join(new)


def test_no_new_private_import(package):
    found = find_private(package)
    new = sorted(found - KNOWN_PRIVATE)
    for entry in sorted(KNOWN_PRIVATE - found):
        print(f"fixed (delete from KNOWN_PRIVATE): {entry}")
    assert not new, "private names imported across modules (make them public or move them):\n" + \
        "\n".join(f"{e}  ({_where(package, e)})" for e in new)


def test_every_installed_package_is_scanned(package):
    """The folders come from setup.cfg: every package the wheel installs is in the graph."""
    assert "spar_bench.experiments" in package
    missing = [p for p in installed_packages(REPO) if not (p in package and package[p].is_package)]
    assert not missing, f"installed but not scanned (map its folder in setup.cfg package_dir): {missing}"


def test_the_core_imports_nothing_above_it(package):
    found = sorted(find_core_imports(package))
    assert not found, ("spar_bench/ (the core) imports from builder/, probes/ or experiments/ "
                       "(move the name into the core, or pass it in):\n" + "\n".join(found))


def test_experiments_reach_the_library_not_the_command_lines(package):
    """Issue 34: an experiment's steps are library calls (specs), never argv handed to a click
    group: no module of ``experiments/`` imports ``probes/cli``, ``builder/cli`` or a CLI command
    (the plan-time value check reads the limits the library's settings classes declare)."""
    assert "spar_bench.experiments.runner" in package
    found = sorted(f"{short(m.name)} imports {short(i)} (line {line})"
                   for m in package.values()
                   if m.name.startswith(PREFIX + "experiments.")
                   for i, line in {**m.imports, **m.typing_only}.items()
                   if any(i == c or i.startswith(c + ".") for c in CLI_MODULES))  # fmt: skip
    assert not found, "experiments/ reaches a CLI:\n" + "\n".join(found)


def test_runs_import_no_kind_package(package):
    """Issue 44: ``probes/runs/`` (the session, the store, the evaluation) stands below the kind
    packages: it imports nothing from ``probes/finetune/`` or ``probes/vqa/`` (a kind says what it
    can do itself, e.g. ``rescore``; reference predictors that need a kind package live in
    ``probes/references/``)."""
    runs, kinds = PREFIX + "probes.runs", (PREFIX + "probes.finetune", PREFIX + "probes.vqa")
    found = sorted(f"{short(m.name)} imports {short(i)} (line {line})"
                   for m in package.values() if m.name == runs or m.name.startswith(runs + ".")
                   for i, line in {**m.imports, **m.typing_only}.items()
                   if any(i == k or i.startswith(k + ".") for k in kinds))  # fmt: skip
    assert not found, "probes/runs/ imports a kind package:\n" + "\n".join(found)


def test_allowlists_are_not_stale(package):
    stale = sorted(KNOWN_CYCLES - find_cycles(package)) + sorted(KNOWN_PRIVATE - find_private(package))
    assert not stale, "fixed; delete from KNOWN_CYCLES / KNOWN_PRIVATE:\n" + "\n".join(stale)


# -- the checker itself, on a synthetic package ------------------------------------------
def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_finds_cycles_and_private_imports(tmp_path):
    _write(tmp_path, {
        "spar_bench/__init__.py": "__version__ = '0'\n",
        "spar_bench/core.py": "def _hidden():\n    pass\n",
        "probes/__init__.py": "from spar_bench import __version__\n",
        # a package __init__ re-exporting its submodules: no cycle
        "probes/heads/__init__.py": "from .a import A\nfrom . import b\n",
        "probes/heads/a.py": "from .b import B\nA = 1\n",
        "probes/heads/b.py": "B = 2\n_x = 3\n",
        # a real cycle through an __init__: the submodule takes a name from it
        "probes/vqa/__init__.py": "from .base import Backend\nREG = {}\n",
        "probes/vqa/base.py": "Backend = 1\ndef f():\n    from . import REG\n",
        # a lazy cycle (inside a function) and private uses of every kind
        "probes/fit.py": ("from typing import TYPE_CHECKING\nimport spar_bench.core as core\n"
                          "from .finetune import run as run_mod\nfrom spar_bench.core import __doc__\n"
                          "if TYPE_CHECKING:\n    from .train import Thing\n"
                          "def _mine():\n    return core._hidden(), run_mod.go\n"),
        "probes/finetune/__init__.py": "",
        "probes/finetune/run.py": ("def go():\n    from ..fit import _mine\n"
                                   "    import spar_bench.probes.heads.b\n"
                                   "    return spar_bench.probes.heads.b._x\n"),
        # a TYPE_CHECKING-only cycle: not reported
        "probes/train.py": "from spar_bench.probes import fit\n_to = 1\n",
    })
    mods = scan(tmp_path)
    assert find_cycles(mods) == {
        "probes.finetune.run -> probes.fit -> probes.finetune.run",
        "probes.vqa -> probes.vqa.base -> probes.vqa",
    }
    assert find_private(mods) == {
        "probes.fit: core._hidden",
        "probes.finetune.run: probes.fit._mine",
        "probes.finetune.run: probes.heads.b._x",
    }
    # fit -> train only under TYPE_CHECKING: left out; were it a real import, a cycle
    fit = mods["spar_bench.probes.fit"]
    assert "spar_bench.probes.train" in fit.typing_only and "spar_bench.probes.train" not in fit.imports
    fit.imports.update(fit.typing_only)
    assert "probes.fit -> probes.train -> probes.fit" in find_cycles(mods)


def test_checker_reads_setup_cfg_and_finds_core_imports(tmp_path):
    _write(tmp_path, {
        "setup.cfg": ("[options]\n# a comment\npackages =\n    spar_bench\n    spar_bench.tools\n"
                      "package_dir =\n    spar_bench = spar_bench\n    spar_bench.tools = tools\n"),
        "spar_bench/__init__.py": "",
        "spar_bench/core.py": "X = 1\n",
        "spar_bench/prov.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .tools import T\n"
                               "def f():\n    from spar_bench.tools.a import A\n    from . import core\n"),
        "tools/__init__.py": "T = 1\n",
        "tools/a.py": "from spar_bench.core import X\nA = X\n",  # down into the core: fine
    })
    dirs = package_dirs(tmp_path)
    assert dirs == {"spar_bench": "spar_bench", "tools": "spar_bench.tools"}
    assert installed_packages(tmp_path) == ["spar_bench", "spar_bench.tools"]
    mods = scan(tmp_path, dirs)
    assert "spar_bench.tools.a" in mods
    assert find_core_imports(mods, dirs) == {"prov -> tools", "prov -> tools.a"}


def test_checker_private_modules_and_longer_cycles(tmp_path):
    _write(tmp_path, {
        "spar_bench/__init__.py": "",
        "builder/__init__.py": "",
        "builder/_impl.py": "X = 1\n",
        "builder/a.py": "from . import _impl\nfrom .b import f\n",  # same package: fine
        "builder/b.py": "from .c import g\ndef f():\n    pass\n",
        "builder/c.py": "def g():\n    from .a import f\n",
        "probes/__init__.py": "",
        "probes/x.py": "from spar_bench.builder import _impl\nimport spar_bench.builder._impl as i\n",
    })
    mods = scan(tmp_path)
    assert find_cycles(mods) == {"builder.a -> builder.b -> builder.c -> builder.a"}
    assert find_private(mods) == {"probes.x: builder._impl"}
