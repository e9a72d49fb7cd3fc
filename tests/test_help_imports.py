"""What a command's ``--help`` imports: no torch, no extra, no heavy library (issue 44: imports
go to the file headers wherever torch and the extras allow, and start-up stays cheap).

Each command group's ``--help`` and its subcommands' run in one fresh interpreter (what one
loads, the next finds loaded: if torch is absent at the end, none loaded it).
``spar-probe fit``, ``sweep`` and ``finetune`` are left out: their ``--help`` shows the head
classes' defaults, which import torch by design (``runs.spec.option_help``, asked only when the
help is shown).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "open_clip", "timm", "monai", "h5py", "datasets", "pyarrow",
         "SimpleITK", "nibabel", "scipy", "matplotlib")
CODE = """
import json, sys
from {module} import cli, main
import click
names = [n for n in cli.list_commands(click.Context(cli)) if n not in {skip!r}]
for argv in [[], *([n] for n in names)]:
    try:
        main([*argv, "--help"])
    except SystemExit:
        pass
print(json.dumps({{"names": names, "modules": sorted({{m.split(".")[0] for m in sys.modules}})}}))
"""


@pytest.mark.parametrize(("module", "skip", "allowed"), [
    ("spar_bench.experiments.cli", (), {"click"}),
    ("spar_bench.probes.cli", ("fit", "sweep", "finetune"), None),
    ("spar_bench.builder.cli", (), None),
])  # fmt: skip
def test_help_loads_no_heavy_library(module, skip, allowed):
    code = CODE.format(module=module, skip=skip)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, encoding="utf-8",
                       errors="replace", timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["names"], "no subcommand listed"
    loaded = set(out["modules"])
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
    if allowed is not None:  # spar-bench --help: click and the standard library only
        third = {m for m in loaded - set(sys.stdlib_module_names)
                 if not m.startswith("_") and m not in ("spar_bench", "__main__")}
        assert third <= allowed, sorted(third - allowed)
