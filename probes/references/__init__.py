"""Reference predictors that read a build and lean on a kind package: the slice oracle (the
answers recomputed from the slices' masks, :mod:`.slice_oracle`, reading the VQA track's
questions) and the appearance reader (:mod:`.reader`, reading organ shares of the organ maps).
They sit above :mod:`spar_bench.probes.runs` (which imports no kind package) and are run kinds
of :data:`spar_bench.probes.kinds.RUN_KINDS` like any other."""
