#!/usr/bin/env bash
# Quantized training's quality (issue 72, docs/quant.md): the 0.6B on the embedded corpus, 200
# steps at 2048 x 8, bf16 against --model.quant int8 (on the chip); with TINY=1 the `tiny` runs
# of the docs' plot instead: 300 steps in float32 (all matmuls at full precision), int8, fp8.
# Prints each run's last eval loss and its ratio to the first's.
#   bash bench/quant_loss.sh           # TINY=1 bash bench/quant_loss.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}; OUT=${OUT:-/tmp/quant-loss}
mkdir -p "$OUT"
if [ "${TINY:-0}" = 1 ]; then
  export JAX_DEFAULT_MATMUL_PRECISION=highest  # a TPU's f32 matmuls otherwise take bf16 passes
  RUN="train_dense.py tiny"; QUANTS="none int8 fp8"
else
  RUN="train_dense.py qwen3-0.6b --train.steps 200 --train.batch-size 8 --train.seq-len 2048
       --train.warmup-steps 20 --train.eval-every 100 --train.eval-batches 8
       --checkpoint.every 0"; QUANTS="none int8"
fi
first=""
for q in $QUANTS; do
  rm -rf "$OUT/$q"
  $PY $RUN --model.quant "$q" --run-dir "$OUT/$q" > "$OUT/$q.log" 2>&1
  loss=$($PY -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]
print(f\"{[x for x in r if 'eval_loss' in x][-1]['eval_loss']:.4f}\")" "$OUT/$q/metrics.jsonl" 2>/dev/null || echo failed)
  [ -z "$first" ] && first=$loss
  ratio=$(awk "BEGIN{printf \"%.4f\", $loss/$first}" 2>/dev/null || echo -)
  echo "$RUN" | head -c 40; printf ' | quant %-5s | eval loss %s | x first %s\n' "$q" "$loss" "$ratio"
done
