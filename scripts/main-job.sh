#!/usr/bin/env bash
# SPAR-Bench main job: phantom -> shards -> feature cache -> heads -> MLLM track (dummy) -> report,
# in about a minute on 2 CPU cores. It is the experiment file experiments/demo.yaml:
#
#   spar-bench run experiments/demo.yaml                  # the same, writes runs/demo
#   OUT=/tmp/spar scripts/main-job.sh                     # elsewhere
#
# Overridable here as environment variables (each is a variable of demo.yaml, also settable with
# spar-bench's --set NAME=VALUE): OUT, N_CASES (12), SAMPLES (8), ENCODER (timm:resnet18),
# SEEDS ([0]), JOBS (2), MAX_EPOCHS (15), BATCH (32). A rerun skips the finished steps.
#
# NOTE: no weights can be downloaded on this machine, so the encoder runs with RANDOM weights
# (random_init). The numbers show that the pipeline works end to end - they say nothing about
# any pretrained model. The report carries a banner saying so.
set -euo pipefail
cd "$(dirname "$0")/.."

sets=()
for name in OUT N_CASES SAMPLES ENCODER SEEDS JOBS MAX_EPOCHS BATCH; do
  if [ -n "${!name:-}" ]; then sets+=(--set "$name=${!name}"); fi
done
start=$(date +%s)
spar-bench run experiments/demo.yaml "${sets[@]}"
printf '\nmain job done in %ss. Report: %s/report/report.md (features were RANDOM-INIT: see its banner)\n' \
  "$(( $(date +%s) - start ))" "${OUT:-runs/demo}"
