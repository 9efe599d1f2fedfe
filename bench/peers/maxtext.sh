#!/bin/bash
# MaxText 0.2.5 (PyPI) on the CPU: the peer of `make bench-parity` (MODEL=dense) and
# `make bench-parity-moe` (MODEL=moe). Installs itself on first use into its own Python 3.12
# venv (MaxText needs 3.12; `maxtext[tpu]` brings its dependencies, plain `maxtext` has none).
#   usage: bench/peers/maxtext.sh dense|moe STEPS LOG
#          bench/peers/maxtext.sh install   (only the install; prints the venv's python)
# Runs STEPS steps on synthetic tokens and leaves MaxText's log in LOG, whose lines
#   completed step: N, seconds: S, ...
# bench/stats.py reads (per-step wall times), and, appended, MaxText's exact parameter count
# ("maxtext num_model_parameters: N", from its TensorBoard summary). The models are train_dense.py's `bench-parity`
# preset and train_moe.py's `bench-parity-moe`: d 256, 4 layers, 4 heads x 64, vocab 32000,
# seq 256, batch 8, float32; dense MLP 1024, or 8 experts top-2 of MLP 512 (Mixtral block).
# Everything else is MaxText's default (base.yml). PEER_DIR (default ~/.cache/jax-trainers/
# peer_maxtext) holds the venv; PYTHON312 names the interpreter to build it with.
set -eu
MODEL=${1:?usage: maxtext.sh dense|moe STEPS LOG, or maxtext.sh install}
P=${PEER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/jax-trainers/peer_maxtext}
# JAX pinned to the release MaxText 0.2.5 was measured with: left free, pip takes the newest,
# whose Pallas kernels (splash attention) a libtpu of the `tpu` extra cannot read back
# ("Failed to deserialize the Mosaic module: Unsupported version"), and the figures drift.
PIN="jax==0.12.0.1 jaxlib==0.12.0.1"
if [ ! -x "$P/venv/bin/python" ] || [ "$(cat "$P/venv/.installed" 2>/dev/null)" != "$PIN" ]; then
  mkdir -p "$P"
  is312() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }
  PY=${PYTHON312:-python3.12}
  if ! is312 "$PY" && command -v pyenv >/dev/null; then  # a pyenv 3.12 that is not the active one
    V=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | tail -1 || true)
    [ -n "$V" ] && PY="$(pyenv root)/versions/$V/bin/python3.12"
  fi
  is312 "$PY" || { echo "maxtext.sh: MaxText 0.2.5 needs Python 3.12: set PYTHON312=/path/to/python3.12" >&2
                   exit 2; }
  echo "maxtext.sh: installing maxtext[tpu]==0.2.5 $PIN into $P/venv (once; a few GB)" >&2
  [ -x "$P/venv/bin/python" ] || "$PY" -m venv "$P/venv"
  "$P/venv/bin/pip" install -q 'maxtext[tpu]==0.2.5' $PIN
  echo "$PIN" > "$P/venv/.installed"
fi
# bench/compile_tpu.py shares this install (one venv, one pinned version) and runs its own
# wrapper (maxtext_compile.py) with the python printed here.
[ "$MODEL" = install ] && { echo "$P/venv/bin/python"; exit 0; }
STEPS=${2:?steps}
LOG=${3:?log file}
case $MODEL in
  dense) BLOCK="base_mlp_dim=1024" ;;
  moe) BLOCK="decoder_block=mixtral num_experts=8 num_experts_per_tok=2 base_mlp_dim=512
              base_moe_mlp_dim=512 megablox=false sparse_matmul=true" ;;
  *) echo "maxtext.sh: MODEL is dense or moe, not '$MODEL'" >&2; exit 2 ;;
esac
CFG=$("$P/venv/bin/python" -c 'import maxtext,os;print(os.path.join(os.path.dirname(maxtext.__file__),"configs","base.yml"))')
RUN=peer_$$
trap 'rm -rf "$P/jax_cache/$RUN" "$P/xla_dump/$RUN" "$P/out/$RUN"' EXIT
# shellcheck disable=SC2086  # BLOCK is a list of key=value words
JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=1 \
"$P/venv/bin/python" -m maxtext.trainers.pre_train.train "$CFG" \
  run_name=$RUN base_output_directory="$P/out" hardware=cpu dataset_type=synthetic \
  base_emb_dim=256 base_num_query_heads=4 base_num_kv_heads=4 base_num_decoder_layers=4 \
  head_dim=64 vocab_size=32000 $BLOCK \
  per_device_batch_size=8 max_target_length=256 steps="$STEPS" \
  enable_checkpointing=false skip_jax_distributed_system=true \
  jax_cache_dir="$P/jax_cache/$RUN" dump_hlo_local_dir="$P/xla_dump/$RUN/" dtype=float32 \
  > "$LOG" 2>&1 || { echo "maxtext.sh: MaxText failed; its log: $LOG" >&2; tail -20 "$LOG" >&2; exit 1; }
"$P/venv/bin/python" "$(dirname "$0")/maxtext_params.py" "$P/out/$RUN" >> "$LOG"
