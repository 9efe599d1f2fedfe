#!/usr/bin/env bash
# Quantized training's quality (issue 72, docs/quant.md): the 0.6B on the embedded corpus, 200
# steps at 2048 x 8, bf16 against --model.quant int8 (on the chip); with TINY=1 the `tiny` runs
# of the docs' plot instead: 300 steps in float32 (all matmuls at full precision), int8, fp8.
# Prints each run's eval losses; runs live under RUNS, their logs and metrics are copied to OUT.
#   bash bench/quant_loss.sh                # QUANTS="none int8" (one at a time: QUANTS=int8)
#   TINY=1 bash bench/quant_loss.sh         # QUANTS="none int8 fp8"
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}; OUT=${OUT:-/tmp/quant-loss}; RUNS=${RUNS:-/tmp/quant-loss-runs}
if [ "${TINY:-0}" = 1 ]; then
  export JAX_DEFAULT_MATMUL_PRECISION=highest  # a TPU's f32 matmuls otherwise take bf16 passes
  RUN="train_dense.py tiny"; QUANTS=${QUANTS:-none int8 fp8}; tag=tiny
else
  RUN="train_dense.py qwen3-0.6b --train.steps 200 --train.batch-size 8 --train.seq-len 2048
       --train.warmup-steps 20 --train.eval-every 100 --train.eval-batches 8
       --checkpoint.every 0"; QUANTS=${QUANTS:-none int8}; tag=qwen3-0.6b
fi
for q in $QUANTS; do
  run="$RUNS/$tag-$q"; rm -rf "$run"; mkdir -p "$OUT/$tag-$q"
  $PY $RUN --model.quant "$q" --run-dir "$run" > "$OUT/$tag-$q/log.txt" 2>&1
  cp "$run/metrics.jsonl" "$OUT/$tag-$q/" 2>/dev/null
  $PY -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]
print(sys.argv[2], '| eval loss', ', '.join(f\"step {x['step']}: {x['eval_loss']:.4f}\"
      for x in r if 'eval_loss' in x))" "$run/metrics.jsonl" "$tag quant $q" 2>/dev/null \
    || echo "$tag quant $q | failed: $OUT/$tag-$q/log.txt"
done
