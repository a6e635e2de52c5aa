#!/usr/bin/env bash
# One prepared GPU check for issue 11 (about 6-8 minutes on one H200), or its CPU smoke run.
#
#   bash scripts/gpu-check.sh --prepare        # here, once: tokenizer (+ wheels) to carry
#   bash scripts/gpu-check.sh [OUTDIR]         # on the GPU machine (OUTDIR or $OUT)
#   bash scripts/gpu-check.sh --cpu-smoke [OUTDIR]   # same steps, tiny sizes, CPU, < 2 min
#
# Steps, each under `timeout` (a failure is recorded and the next step runs):
#   1 pytest -m gpu                     CUDA-gated tests (GPU mode only; the Triton
#                                       attention and UVA copy kernels compiled) (<= 100 s)
#   2 make_random_model.py              1B Llama-shaped bf16 model on the GPU   (<= 30 s)
#   3 engine_vs_hf.py                   9 chat prompts, fp32 + bf16, engine vs transformers (<= 75 s)
#   4 hicache bench transfer            --device cuda --dtype bfloat16, page 64 (<= 35 s)
#   5 hicache bench engine              --device cuda --dtype bfloat16, the 1B model; decode
#                                       with the SDPA gather, the Triton kernel, and the
#                                       Triton kernel replayed as CUDA graphs  (<= 90 s)
#   6 hicache bench multiturn           1B model, 64 clients x 5 rounds x (512 + 32),
#                                       --max-parallel 16, configs l1,l1_l2, 2
#                                       alternating repetitions (A B, B A)      (<= 150 s)
# The limits add up to 8 minutes; the steps' own time is expected well under that.
# Every step writes its JSON (and log) under OUTDIR; summary.json lists each step's exit
# status and seconds. The GPU machine reaches no index: the SmolLM2 tokenizer travels in
# .gpu/tokenizer, missing Python packages as wheels in .whl (carry both: run's
# carry=[".gpu", ".whl"]); --prepare makes them here.
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
MODE=gpu
case "${1:-}" in
  --prepare) MODE=prepare; shift ;;
  --cpu-smoke) MODE=cpu; shift ;;
esac

if [ "$MODE" = prepare ]; then
  PY=${PY:-$ROOT/.venv/bin/python}
  mkdir -p .git/info .gpu/tokenizer
  for p in /.gpu/ /.whl/; do grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >>.git/info/exclude; done
  TOK=$("$PY" -c 'from hicache.runner.checkpoints import resolve_checkpoint; print(resolve_checkpoint(None).path)')
  for f in tokenizer.json tokenizer_config.json chat_template.jinja; do
    [ -f "$TOK/$f" ] && cp "$TOK/$f" .gpu/tokenizer/
  done
  # packages the server needs that the GPU image lacks (KINDS.md's list), pinned to ours
  WHEELS=""
  for name in fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection; do
    v=$("$PY" -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}')
    [ -n "$v" ] && WHEELS="$WHEELS $name==$v"
  done
  mkdir -p .whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl $WHEELS
  du -sh .gpu .whl
  exit 0
fi

OUTDIR=${1:-${OUT:-$ROOT/gpu-check-out}}
mkdir -p "$OUTDIR"
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HICACHE_CACHE_DIR="$WORK/cache"

if [ "$MODE" = gpu ]; then
  PY=${PY:-python3}
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}
  DEVICE=cuda SHAPE="" MODEL_DTYPE=bfloat16
  TOKDIR=$ROOT/.gpu/tokenizer
  MT_ARGS="--num-clients 64 --num-rounds 5 --request-length 512 --output-length 32 --max-parallel 16 --repeats 2"
  TR_ARGS="--page-sizes 64 --repeat 5"
  EN_ARGS="--prefill-tokens 2048 --decode-seqs 16 --decode-context 2048 --decode-steps 32 --attention-backends sdpa,triton --cuda-graphs"
  # Triton compiles the attention and copy kernels in the first two steps; engines
  # (steps 3 and 6) and --cuda-graphs capture decode graphs at start (a few seconds)
  T_TEST=100 T_MODEL=30 T_CMP=75 T_TR=35 T_EN=90 T_MT=150
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUTDIR/nvidia-smi.txt" 2>&1
else
  PY=${PY:-$ROOT/.venv/bin/python}
  export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}  # this tree, not the venv's install
  DEVICE=cpu SHAPE=--tiny MODEL_DTYPE=float32
  TOKDIR=${TOKDIR:-$("$PY" -c 'from hicache.runner.checkpoints import resolve_checkpoint; print(resolve_checkpoint("tiny-random-llama").path)' 2>/dev/null)}
  MT_ARGS="--num-clients 4 --num-rounds 2 --request-length 64 --output-length 4 --max-parallel 2 --repeats 2"
  TR_ARGS="--page-sizes 16 --pages 8 --layers 4 --repeat 1"
  EN_ARGS="--prefill-tokens 64 --decode-seqs 2 --decode-context 32 --decode-steps 4 --repeat 1 --cuda-graphs"
  T_TEST=60 T_MODEL=30 T_CMP=40 T_TR=30 T_EN=40 T_MT=90
fi
MODEL=$WORK/model
SUMMARY=()

step() {  # step NAME SECONDS CMD...: run under timeout, log to OUTDIR/NAME.log, record
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS rc
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" >"$OUTDIR/$name.log" 2>&1
  rc=$?
  tail -n 5 "$OUTDIR/$name.log"
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  SUMMARY+=("{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0)), \"timed_out\": $([ $rc = 124 ] || [ $rc = 137 ] && echo true || echo false)}")
}

if [ "$MODE" = gpu ]; then
  step pytest_gpu "$T_TEST" "$PY" -m pytest -q -m gpu -p no:cacheprovider --junitxml="$OUTDIR/pytest_gpu.xml" tests
fi
step make_model "$T_MODEL" "$PY" scripts/make_random_model.py --tokenizer "$TOKDIR" --out "$MODEL" \
  $SHAPE --dtype "$MODEL_DTYPE" --device "$DEVICE"
step engine_vs_hf "$T_CMP" "$PY" scripts/engine_vs_hf.py --model-path "$MODEL" --device "$DEVICE" \
  --json "$OUTDIR/engine_vs_hf.json"
step bench_transfer "$T_TR" "$PY" -m hicache.cli bench transfer --device "$DEVICE" --dtype bfloat16 \
  $TR_ARGS --json "$OUTDIR/bench_transfer.json"
step bench_engine "$T_EN" "$PY" -m hicache.cli bench engine --model-path "$MODEL" --device "$DEVICE" \
  --dtype bfloat16 $EN_ARGS --json "$OUTDIR/bench_engine.json"
step multiturn "$T_MT" "$PY" -m hicache.cli bench multiturn --model-path "$MODEL" --configs l1,l1_l2 \
  $MT_ARGS --json "$OUTDIR/multiturn.json"

{
  echo "{\"mode\": \"$MODE\", \"steps\": ["
  for i in "${!SUMMARY[@]}"; do
    [ "$i" -gt 0 ] && echo ","
    echo "${SUMMARY[$i]}"
  done
  echo "]}"
} >"$OUTDIR/summary.json"
cat "$OUTDIR/summary.json"
rm -rf "$WORK"
FAILED=$(grep -c '"rc": [1-9]' "$OUTDIR/summary.json")
echo "gpu-check ($MODE): $FAILED step(s) failed; JSON and logs in $OUTDIR"
[ "$FAILED" = 0 ]
