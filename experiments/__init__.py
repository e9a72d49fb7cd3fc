"""Experiment files: one YAML runs the paper's grid as a resumable plan (spar-bench run), and its report."""
