"""The run lifecycle, once for every run kind (a head on cached features, a finetuned
encoder, an MLLM, a reference predictor):

* :mod:`.spec`       - :class:`~.spec.RunSpec` (and :class:`~.spec.PredictorSpec`): what a run is;
* :mod:`.inputs`     - its cache and build, checked; targets split by patient; features;
* :mod:`.predictors` - the :class:`~.predictors.Predictor` interface (``fit``/``predict``/``blind``)
  and the head, blind-head and constant-prior predictors;
* :mod:`.mask_oracle` - Level 4's mask oracle: every answer from the stored label volumes;
* :mod:`.evaluate`   - the one evaluation: test, mirror, chance, majority, prior, blind, transfer;
* :mod:`.store`      - the run folder: its name from the options, ownership, the finished-run
  check, ``metrics.json`` written last;
* :mod:`.session`    - the runner: one run, a batch trained together, any predictor on a build;
* :mod:`.sweep`      - many runs over processes, partitions and ids (``spar-probe sweep``);
* :mod:`.report`     - finished runs read back: tables, ``report.md``/``report.json`` and plots
  (``spar-probe report``).

The click commands live in :mod:`spar_bench.probes.cli`; nothing here parses a command line.
"""
