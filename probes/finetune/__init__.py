"""Encoders that learn: ``spar-probe finetune`` trains an encoder and a probe head end to end.

* :mod:`.config`  - :class:`FinetuneConfig` and the warm-up + cosine schedule;
* :mod:`.model`   - the encoder as a trainable module: weights or ``--init scratch``,
  freezing the first blocks, forward with gradients, the safetensors export;
* :mod:`.data`    - batches of build images read by a DataLoader, seeded epoch order;
* :mod:`.loop`    - the training loop: autocast, accumulation, validation, early stopping,
  checkpoints and exact resume;
* :mod:`.organmaps` - organ-map pretraining: an encoder trained from scratch to say which
  organs each token covers (the calibration's computation model);
* :mod:`.readout` - its geometric readout, a predictor (each organ's centre and area from the
  maps, then the oracle's rule);
* :mod:`.run`     - one run end to end (targets, controls, scores and the run folder of
  ``spar-probe fit``) and the ``finetune`` command.
"""
