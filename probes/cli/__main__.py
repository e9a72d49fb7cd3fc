"""``python -m spar_bench.probes.cli``: the ``spar-probe`` command."""

from . import main

main()
