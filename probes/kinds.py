"""Run kinds: ``kind`` -> the class that runs it, as ``HEADS`` is for heads (lazy: a kind's
package is imported only when a run of it is made).

:func:`spar_bench.probes.runs.session.run` makes every run from its spec through this registry
(``spec.kind``). A kind's class either opens its own job (``open(spec, out, options)``: see
:class:`~spar_bench.probes.runs.session.Job`) or is a predictor made from a build
(``on_build(probe_spec, build)``) with ``fit``, ``predict`` and ``blind``
(:class:`~spar_bench.probes.runs.predictors.Predictor`), run on the build's splits with every
control. A new kind is one class and one line here (or ``PREDICTORS.register`` from a plug-in).
"""

from __future__ import annotations

from spar_bench.registry import Registry

PREDICTORS: Registry = Registry("run kind")
PREDICTORS.register_lazy("head", "spar_bench.probes.runs.session:HeadJob")
PREDICTORS.register_lazy("finetune", "spar_bench.probes.finetune.predictor:FinetuneJob")
PREDICTORS.register_lazy("mllm", "spar_bench.probes.vqa.predictor:MllmJob")
PREDICTORS.register_lazy("prior", "spar_bench.probes.runs.predictors:ConstantPrior")
PREDICTORS.register_lazy("oracle", "spar_bench.probes.runs.mask_oracle:MaskOracle")
