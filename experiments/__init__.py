"""Experiment files: one YAML runs the paper's grid as a resumable plan (``spar-bench run``),
and its report.

* :mod:`.config`   - read and validate an experiment file (variables, one-line errors);
* :mod:`.values`   - every value of the file and ``--devices`` checked before any step runs;
* :mod:`.plan`     - the file as steps, each identified by the hash of its inputs and options;
* :mod:`.steps`    - the registry of step kinds (:data:`~.steps.STEPS`), each declared once in
  :mod:`.step_kinds`: its options, their checks, its steps and its library call;
* :mod:`.runner`   - run a plan: skip what is done, redo what changed, resume, partitions, devices;
* :mod:`.estimate` - what a plan costs (images, runs, questions; time on 2 CPU cores and one GPU);
* :mod:`.report`   - the experiment's report: the paper's tables with the provenance of each cell;
* :mod:`.legacy`   - the step hashes of 0.2 (steps held argv), to keep the steps of older folders;
* :mod:`.sizes`    - a build's cases, images and questions before it exists (``sizes.json``: measured);
* ``*.yaml``       - presets shipped with the package: ``demo`` (the main job), ``paper`` (the
  paper's 13 configurations), ``paper-extended`` (20 rows), ``recall-vs-computation``,
  ``volumes`` (Level 4), ``word-real-weights`` (real weights on WORD maps), ``mllm-stages`` (the paper's four MLLMs by stage; its dry run needs the
  models' folders).
"""

from __future__ import annotations

import difflib
from pathlib import Path

from spar_bench.errors import ConfigError

#: the experiment files shipped with the package
PRESETS = ("demo", "paper", "paper-extended", "recall-vs-computation", "volumes", "word-real-weights", "mllm-stages",
           "ct-foundation")


def preset_path(name: str) -> Path:
    """The shipped experiment file ``name`` (``demo`` -> ``.../experiments/demo.yaml``)."""
    p = Path(__file__).with_name(f"{name}.yaml")
    if name in PRESETS and p.is_file():
        return p

    close = difflib.get_close_matches(name, PRESETS, n=1)
    hint = f"; did you mean {close[0]}?" if close else f"; presets: {', '.join(PRESETS)}"
    raise ConfigError(f"{name}: no such experiment file or preset{hint}")
