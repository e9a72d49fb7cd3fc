"""The PNG plots (issue 46): experiment.png marks each bar's blind baseline; a per-probe PNG's
configuration labels never overlap (upright when they would)."""

from __future__ import annotations

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")


def test_experiment_png_marks_the_blind_baseline_on_each_bar() -> None:
    import matplotlib.pyplot as plt

    from spar_bench.experiments.report import _bars

    cell = {"percent": True, "metric": "accuracy", "test": {"mean": 0.8, "ci_low": 0.7, "ci_high": 0.9},
            "blind": {"mean": 0.6}}
    rows = [{"mode": "frozen", "cells": {"p": cell}}, {"mode": "MLLM", "cells": {"p": {**cell, "blind": None}}}]
    fig, ax = plt.subplots()
    _bars(ax, "p", rows, {})
    marks = [c for c in ax.collections if c.get_label() == "blind"]
    assert len(marks) == 1
    y = np.ma.filled(np.ma.asarray(marks[0].get_offsets())[:, 1].astype(float), np.nan)
    assert y[0] == pytest.approx(60.0) and np.isnan(y[1])  # in %, none where the row has no blind
    plt.close(fig)


def test_long_configuration_labels_are_turned_upright_not_overlapped() -> None:
    import matplotlib.pyplot as plt

    from spar_bench.probes.runs.report import overlapping, separate_labels

    labels = [f"timm:vit_base_patch16_224.augreg_in21k_{i}\nlinear-probe-with-a-long-name" for i in range(8)]
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(np.arange(8), np.ones(8))
    ax.set_xticks(np.arange(8), labels, fontsize=7)
    fig.canvas.draw()
    assert overlapping([t.get_window_extent() for t in ax.get_xticklabels()])  # as drawn before
    separate_labels(fig, ax)
    fig.canvas.draw()
    assert not overlapping([t.get_window_extent() for t in ax.get_xticklabels()])
    plt.close(fig)
