#!/usr/bin/env bash
# Quantized training on one TPU chip (issue 72, docs/quant.md): the 0.6B dense row and the MoE
# row of `make bench-tpu` (issue 71), bf16 against --model.quant int8 (and fp8, which a v5e,
# having no fp8 units, runs as bf16), in one invocation; prints one table. Every column's MFU
# counts the same bf16 FLOPs against the chip's bf16 peak (int8's peak is twice that on a v5e).
#   bash bench/quant_tpu.sh     # N=10 timed steps a run; QUANTS="none int8 fp8"; ROWS=moe-2k
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}; N=${N:-10}; QUANTS=${QUANTS:-none int8 fp8}; OUT=${OUT:-/tmp/quant-bench}
mkdir -p "$OUT"
declare -A ROW=(
  [qwen3-0.6b-2k]="train_dense.py qwen3-0.6b --train.batch-size 8 --train.seq-len 2048"
  # Qwen3-30B-A3B's block, 2 layers, 32 experts, vocab 32k; its experts' megablox kernel takes
  # floats only: their operands are rounded around it (docs/quant.md), attention runs in int8
  [moe-2k]="train_moe.py qwen3-30b-a3b --model.n-layers 2 --model.n-experts 32 --model.vocab-size 32000 --train.batch-size 8 --train.seq-len 2048 --no-bench-twin"
)
printf '%-16s %-5s %10s %10s %8s %8s\n' row quant "tok/s" "ms/step" MFU "x bf16" > "$OUT/table.txt"
for row in ${ROWS:-qwen3-0.6b-2k moe-2k}; do
  base=""
  for q in $QUANTS; do
    log="$OUT/$row-$q.log"
    $PY ${ROW[$row]} --model.quant "$q" --bench "$N" --run-dir "$OUT/runs/$row-$q" > "$log" 2>&1
    line=$(grep -E '^bench( moe)? \| [0-9]+ tok/s' "$log" | tail -1)
    tok=$(sed -E 's/^bench( moe)? \| ([0-9]+) tok\/s.*/\2/' <<< "$line")
    ms=$(sed -E 's/.*\| ([0-9.]+) ms\/step.*/\1/' <<< "$line")
    mfu=$(grep -oE 'MFU [0-9.]+%' <<< "$line" | cut -d' ' -f2)
    if [ -z "$line" ]; then tok=failed; ms="see $log"; mfu=-; fi
    [ "$q" = none ] && base=$tok
    ratio=$( [[ "$tok" =~ ^[0-9]+$ && "$base" =~ ^[0-9]+$ ]] && awk "BEGIN{printf \"%.2f\", $tok/$base}" || echo -)
    printf '%-16s %-5s %10s %10s %8s %8s\n' "$row" "$q" "$tok" "$ms" "$mfu" "$ratio" | tee -a "$OUT/table.txt"
  done
done
echo; cat "$OUT/table.txt"
