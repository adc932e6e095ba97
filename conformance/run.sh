#!/usr/bin/env bash
# Reference suite: transformers' own common model tests on BERT/GPT-2/BART (in-library) and on coreformer's families.
#
#   ./run.sh CHECKOUT            e.g. ./run.sh /work/main     (uses CHECKOUT/.venv/bin/python, coreformer from CHECKOUT)
#   PY=/path/to/python ./run.sh CHECKOUT   another interpreter (e.g. a venv with an older transformers); coreformer
#                                  must still import from CHECKOUT (installed editable in that venv)
#   REUSE_REF=1 ./run.sh CHECKOUT  reuse the reference results of an earlier run with the same transformers version
#   WORKERS=1 ./run.sh CHECKOUT    pytest-xdist workers (default 2, the most this machine should use)
#   EXTRA="-k generate" ./run.sh CHECKOUT   extra pytest arguments for both runs
#
# Test tree: upstream/<transformers version>/ (e.g. upstream/5.24.0), chosen by the version PY imports; it is
# transformers' (see UPSTREAM.md and upstream/<version>/SOURCES.md); nothing under upstream/ is committed to the project.
# Results: results/<checkout name>-<transformers version>/{ref.xml,ours.xml,ref.log,ours.log,summary.json}; the summary
# is printed.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
CHECKOUT="$(cd "${1:?usage: run.sh CHECKOUT}" && pwd)"
PY="${PY:-$CHECKOUT/.venv/bin/python}"
[ -x "$PY" ] || { echo "no $PY: the checkout needs its .venv (with coreformer installed editable), or set PY" >&2; exit 2; }
WORKERS="${WORKERS:-2}"
NAME="$(basename "$CHECKOUT")"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
# Test-only packages the upstream tests import and the checkouts' venvs lack (parameterized, httpx, timeout-decorator,
# pytest-timeout), kept out of the venvs.
export PYTHONPATH="$HERE/pydeps${PYTHONPATH:+:$PYTHONPATH}"

# The coreformer import must come from this checkout.
"$PY" - "$CHECKOUT" <<'EOF'
import os, sys, coreformer, transformers
src = os.path.realpath(os.path.dirname(coreformer.__file__))
if not src.startswith(os.path.realpath(sys.argv[1]) + os.sep):
    sys.exit(f"coreformer imports from {src}, not from {sys.argv[1]}: reinstall it editable in {sys.executable}'s venv")
print(f"coreformer from {src}; transformers {transformers.__version__}")
EOF
TRANSFORMERS_DIR="$("$PY" -c 'import os, transformers; print(os.path.dirname(transformers.__file__))')"
TRANSFORMERS_VERSION="$("$PY" -c 'import transformers; print(transformers.__version__)')"
UPSTREAM="$HERE/upstream/$TRANSFORMERS_VERSION"
[ -d "$UPSTREAM/tests" ] || { echo "no $UPSTREAM/tests: assemble that release's test tree (UPSTREAM.md)" >&2; exit 2; }
OUT="$HERE/results/$NAME-$TRANSFORMERS_VERSION${EXTRA:+-partial}"   # a run narrowed by EXTRA never overwrites a full one
mkdir -p "$OUT"
echo "test tree $UPSTREAM; results $OUT"

cd "$UPSTREAM"
# test_pipeline_mixin imports <repo>/src/transformers directly: point it at the checkout's installed copy.
mkdir -p src && ln -sfn "$TRANSFORMERS_DIR" src/transformers
mkdir -p tests/models/coreformer && touch tests/models/coreformer/__init__.py
cp "$HERE/test_coreformer_common.py" tests/models/coreformer/test_modeling_coreformer.py

# Distributed (tensor-parallel / FSDP / expert-parallel) tests are left out: their helper module is not in the
# sdists (see UPSTREAM.md) and they spawn process groups this shared 2-core machine cannot spare.
PYTEST=("$PY" -m pytest -p no:cacheprovider -q -o log_cli=false -n "$WORKERS" --timeout 900
        -m "not is_tensor_parallel_test and not is_fsdp_test and not is_expert_parallel_test" ${EXTRA:-})

REF_STAMP="$HERE/results/ref-transformers-$TRANSFORMERS_VERSION.xml"
if [ "${REUSE_REF:-0}" = 1 ] && [ -f "$REF_STAMP" ] && [ -z "${EXTRA:-}" ]; then
  echo "reusing reference results $REF_STAMP"
  cp "$REF_STAMP" "$OUT/ref.xml"
else
  echo "(a) in-library references: BertModelTest, GPT2ModelTest, BartModelTest"
  "${PYTEST[@]}" --junitxml="$OUT/ref.xml" \
    tests/models/bert/test_modeling_bert.py::BertModelTest \
    tests/models/gpt2/test_modeling_gpt2.py::GPT2ModelTest \
    tests/models/bart/test_modeling_bart.py::BartModelTest > "$OUT/ref.log" 2>&1 || true
  tail -n 1 "$OUT/ref.log"
  [ -n "${EXTRA:-}" ] || cp "$OUT/ref.xml" "$REF_STAMP"
fi

echo "(b) coreformer: CoreformerEncoderModelTest, CoreformerDecoderModelTest, CoreformerSeq2SeqModelTest"
"${PYTEST[@]}" --junitxml="$OUT/ours.xml" tests/models/coreformer/test_modeling_coreformer.py > "$OUT/ours.log" 2>&1 || true
tail -n 1 "$OUT/ours.log"

"$PY" "$HERE/summarize.py" "$OUT/ref.xml" "$OUT/ours.xml" "$OUT/summary.json" ${DETAILS:+--details}
