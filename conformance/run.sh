#!/usr/bin/env bash
# Reference suite: transformers' own common model tests on BERT/GPT-2/BART (in-library) and on coreformer's families.
#
#   ./run.sh CHECKOUT            e.g. ./run.sh /work/main     (uses CHECKOUT/.venv/bin/python, coreformer from CHECKOUT)
#   REUSE_REF=1 ./run.sh CHECKOUT  reuse the reference results of an earlier run with the same transformers version
#   WORKERS=1 ./run.sh CHECKOUT    pytest-xdist workers (default 2, the most this machine should use)
#   EXTRA="-k generate" ./run.sh CHECKOUT   extra pytest arguments for both runs
#
# Results: results/<checkout name>/{ref.xml,ours.xml,ref.log,ours.log,summary.json}; the summary is printed.
# The test tree in upstream/ is transformers' (see upstream/SOURCES.md); nothing here is committed to the project.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
CHECKOUT="$(cd "${1:?usage: run.sh CHECKOUT}" && pwd)"
PY="$CHECKOUT/.venv/bin/python"
[ -x "$PY" ] || { echo "no $PY: the checkout needs its .venv (with coreformer installed editable)" >&2; exit 2; }
WORKERS="${WORKERS:-2}"
NAME="$(basename "$CHECKOUT")"
OUT="$HERE/results/$NAME${EXTRA:+-partial}"   # a run narrowed by EXTRA never overwrites a full one
mkdir -p "$OUT"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
# Test-only packages the upstream tests import and the checkouts' venvs lack (parameterized, httpx, timeout-decorator,
# pytest-timeout), kept out of the venvs.
export PYTHONPATH="$HERE/pydeps${PYTHONPATH:+:$PYTHONPATH}"

# The coreformer import must come from this checkout.
"$PY" - "$CHECKOUT" <<'EOF'
import os, sys, coreformer, transformers
src = os.path.realpath(os.path.dirname(coreformer.__file__))
if not src.startswith(os.path.realpath(sys.argv[1]) + os.sep):
    sys.exit(f"coreformer imports from {src}, not from {sys.argv[1]}: reinstall it editable in that checkout's .venv")
print(f"coreformer from {src}; transformers {transformers.__version__}")
EOF
TRANSFORMERS_DIR="$("$PY" -c 'import os, transformers; print(os.path.dirname(transformers.__file__))')"
TRANSFORMERS_VERSION="$("$PY" -c 'import transformers; print(transformers.__version__)')"

cd "$HERE/upstream"
# test_pipeline_mixin imports <repo>/src/transformers directly: point it at the checkout's installed copy.
mkdir -p src && ln -sfn "$TRANSFORMERS_DIR" src/transformers
mkdir -p tests/models/coreformer && touch tests/models/coreformer/__init__.py
cp "$HERE/test_coreformer_common.py" tests/models/coreformer/test_modeling_coreformer.py

# Distributed (tensor-parallel / FSDP) tests are left out: their helper module is not in the 5.23 sdist (see
# upstream/SOURCES.md) and they spawn process groups this shared 2-core machine cannot spare.
PYTEST=("$PY" -m pytest -p no:cacheprovider -q -o log_cli=false -n "$WORKERS" --timeout 900
        -m "not is_tensor_parallel_test and not is_fsdp_test" ${EXTRA:-})

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
