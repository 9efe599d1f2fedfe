#!/bin/bash
# TRL 1.13.0's GRPOTrainer on the CPU: the peer of `make bench-grpo`. Installs itself on first
# use into its own venv (torch, transformers, TRL: the versions measured in the README), then
# runs bench/peers/trl_grpo.py with the arguments given (bench/grpo.py passes them).
#   usage: bench/peers/trl.sh --model HF_DIR --prompts P.json --steps N ... > LOG
# PEER_DIR (default ~/.cache/jax-trainers/peer_trl) holds the venv; PYTHON builds it
# (default python3; TRL 1.13 needs >= 3.10). A CPU-only torch saves gigabytes: set
# PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel index before the first run.
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
P=${PEER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/jax-trainers/peer_trl}
if [ ! -f "$P/venv/.installed" ]; then
  mkdir -p "$P"
  echo "trl.sh: installing trl==1.13.0, transformers==5.24.0, torch==2.13.0 into $P/venv (once)" >&2
  "${PYTHON:-python3}" -m venv "$P/venv"
  "$P/venv/bin/pip" install -q 'trl==1.13.0' 'transformers==5.24.0' 'torch==2.13.0' requests  # TRL's GRPO imports it, undeclared
  touch "$P/venv/.installed"
fi
exec "$P/venv/bin/python" "$HERE/trl_grpo.py" "$@"
