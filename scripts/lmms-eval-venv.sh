#!/usr/bin/env bash
# lmms-eval's own virtual environment, beside SPAR-Bench's (its dependencies would bloat [all]):
# lmms-eval 0.7.3 (pinned: the version the export is tested with), what it needs and does not
# declare (filelock<4, decord), torch as pip resolves it here, and this checkout (editable: the
# exported utils.py imports spar_bench). tests/test_lmms_eval.py runs lmms-eval from it;
# .ci/run makes it and passes its executable in SPAR_LMMS_EVAL.
#
#   scripts/lmms-eval-venv.sh [DIR]      # default ${TMPDIR:-/tmp}/spar-ci-lmms
#
# Prints the venv's lmms-eval executable (the last line of stdout; pip's output goes to stderr).
# Quick when DIR already holds this venv for this checkout and the exported utils.py's import of
# spar_bench works there (else it is made again); a DIR it did not make is refused.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-${TMPDIR:-/tmp}/spar-ci-lmms}
PYTHON=${PYTHON:-python3}
REQUIREMENTS=("lmms-eval==0.7.3" "filelock<4" "decord")
MARK="$VENV/.spar-lmms-venv"  # written when the venv is made; holds what it was made with once done
WANT="${REQUIREMENTS[*]} -e $REPO"

if [ -f "$MARK" ] && [ "$(cat "$MARK")" = "$WANT" ] \
   && "$VENV/bin/python" -c "import lmms_eval, spar_bench.probes.vqa.parse" 2>/dev/null; then
  echo "$VENV/bin/lmms-eval"
  exit 0
fi
if [ -e "$VENV" ] && [ ! -f "$MARK" ] && [ -n "$(ls -A "$VENV")" ]; then
  echo "error: $VENV is not empty and was not made by $0: remove it or pass another folder" >&2
  exit 2
fi
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
: > "$MARK"
"$VENV/bin/python" -m pip install --quiet "${REQUIREMENTS[@]}" -e "$REPO" >&2
"$VENV/bin/python" -c "import lmms_eval, spar_bench.probes.vqa.parse, decord" >&2
echo "$WANT" > "$MARK"
echo "$VENV/bin/lmms-eval"
