#!/usr/bin/env bash
# SPAR-Bench main job: phantom -> shards -> feature cache -> sweep -> MLLM track (dummy) -> report,
# in a few minutes on 2 CPU cores.
#
#   scripts/main-job.sh                 # writes everything under runs/demo
#   OUT=/tmp/spar scripts/main-job.sh   # elsewhere
#
# Overridable: OUT, N_CASES (12), SAMPLES (8), ENCODER (timm:resnet18), HEADS (mlp,transformer),
# SEEDS (0), JOBS (2), MAX_EPOCHS (15), BATCH (32: the phantom train split is small).
#
# NOTE: no weights can be downloaded on this machine, so the encoder runs with RANDOM weights
# (--random-init). The numbers show that the pipeline works end to end - they say nothing about
# any pretrained model. The report carries a banner saying so.
set -euo pipefail

OUT=${OUT:-runs/demo}
N_CASES=${N_CASES:-12}
SAMPLES=${SAMPLES:-8}
ENCODER=${ENCODER:-timm:resnet18}
HEADS=${HEADS:-mlp,transformer}
SEEDS=${SEEDS:-0}
JOBS=${JOBS:-2}
MAX_EPOCHS=${MAX_EPOCHS:-15}
BATCH=${BATCH:-32}
NAME=$(echo "$ENCODER" | tr ':/' '--')

step() { printf '\n== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }
start=$(date +%s)
mkdir -p "$OUT"

step "1/6 phantom: $N_CASES canonical cases"
spar-build phantom --out "$OUT/phantom" --n "$N_CASES" --layout canonical --overwrite

step "2/6 shards: $SAMPLES samples per case, with mirrored counterfactuals"
spar-build --source phantom --root "$OUT/phantom" --out "$OUT/shards" \
  --samples-per-case "$SAMPLES" --counterfactual mirror --no-hf --jobs "$JOBS" --overwrite

step "3/6 feature cache: $ENCODER with RANDOM weights (none can be downloaded here)"
spar-probe cache --encoder "$ENCODER" --random-init --data "$OUT/shards" \
  --out "$OUT/cache/$NAME.h5" --overwrite

step "4/6 sweep: heads $HEADS x all probes x seeds $SEEDS on $JOBS processes"
spar-probe sweep --features "$OUT/cache/$NAME.h5" --head "$HEADS" --probe all \
  --seeds "$SEEDS" --jobs "$JOBS" --max-epochs "$MAX_EPOCHS" --batch-size "$BATCH" \
  --out "$OUT/runs"

step "5/6 MLLM track: the Level 3 questions asked to the dummy model (seeded answers; no LLM here)"
spar-probe vqa --model dummy --data "$OUT/shards" --out "$OUT/runs"

step "6/6 report"
spar-probe report "$OUT/runs" --out "$OUT/report"

printf '\nmain job done in %ss. Report: %s/report/report.md (features were RANDOM-INIT: see its banner)\n' \
  "$(( $(date +%s) - start ))" "$OUT"
