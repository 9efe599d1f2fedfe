# Every target installs the project into $(VENV) on first use: a fresh machine needs only
# Python and make. Override PYTHON/VENV to use another interpreter, ARGS to pass flags.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
ARGS   ?=
PRESET ?= tiny
# pip extras installed into the venv: 'cuda,test' on a GPU node, 'tpu' on a TPU VM.
EXTRAS ?= test
MOE_PRESET ?= tiny-moe
GRPO_PRESET ?= tiny
# A run directory (--run-dir) for plot and tensorboard; several, space-separated, to compare.
RUN    ?=
PORT   ?= 6006
comma  := ,

.DEFAULT_GOAL := help
.PHONY: help train distill test test-floors test-tpu test-chip muonclip-demo bench bench-gpu bench-tpu bench-context bench-window bench-parity bench-parity-moe bench-grpo bench-grpo-tpu bench-recovery bench-scale compile-tpu dry-run prepare clean train-moe bench-moe train-grpo \
        plot tensorboard need-run sft dpo export-hf finetune-hf hf-fixtures eval

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

train: $(VENV)/.installed  ## train the tiny model on the embedded corpus (resumes if run again)
	$(PY) train_dense.py $(PRESET) $(ARGS)

sft: $(VENV)/.installed  ## fine-tune the `make train` model (trained first if missing) on generated Q&A
	@test -d runs/tiny/checkpoints || $(MAKE) --no-print-directory train PRESET=tiny ARGS=
	$(PY) tools/sft_demo.py --out data/sft-demo
	$(PY) train_dense.py tiny-sft $(ARGS)

dpo: $(VENV)/.installed  ## DPO of the `make sft` model (made first if missing): right answers over wrong ones
	@test -d runs/tiny-sft/checkpoints || $(MAKE) --no-print-directory sft ARGS=
	$(PY) tools/sft_demo.py --dpo --out data/dpo-demo
	$(PY) train_dense.py tiny-dpo $(ARGS)

distill: $(VENV)/.installed  ## a 1.4M student of the `make train` model (trained first if missing), taught by it
	@test -d runs/tiny/checkpoints || $(MAKE) --no-print-directory train PRESET=tiny ARGS=
	$(PY) train_dense.py tiny-distill $(ARGS)

train-moe: $(VENV)/.installed  ## train the tiny mixture of experts (MOE_PRESET) on the embedded corpus; resumes
	$(PY) train_moe.py $(MOE_PRESET) $(ARGS)

train-grpo: $(VENV)/.installed  ## SFT warm start, then GRPO (GRPO_PRESET) on reversed addition, on the CPU; resumes
	$(PY) train_grpo.py $(GRPO_PRESET) $(ARGS)

# A pytest worker per core, at most one per 3 GiB of memory (tests/workers.py): 2 on a 2-core
# machine, a workstation's cores all used. TEST_WORKERS=n overrides.
TEST_WORKERS ?= $(shell $(PYTHON) tests/workers.py)
test: $(VENV)/.installed  ## run the test suite on 8 simulated CPU devices, a worker per core
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal tests $(ARGS)

# The lowest versions pyproject.toml allows, pinned (pip has no lowest-version resolution):
# the tests of every optimiser (test_muon.py holds AdamW's and Muon's updates to their formulas
# and to optax's scale_by_muon), the HF path, checkpoints and the command line, on them.
# test_unchanged.py's trajectories and test_guard.py's ranges stay on the two main legs: what
# they hold is the trainers' code, not the libraries', and CI's whole run must stay short.
FLOORS_VENV ?= .venv-floors
FLOOR_TESTS ?= tests/test_muon.py tests/test_train.py tests/test_hf.py tests/test_checkpoint.py
test-floors:  ## FLOOR_TESTS on the lowest versions of every dependency pyproject.toml declares
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(PYTHON) -c 'import re, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	  print("\n".join(re.sub(r"\[.*\]", "", d).replace(">=", "==") for d in \
	  p["dependencies"] + p["optional-dependencies"]["test"]))' > $(FLOORS_VENV)/floors.txt
	$(FLOORS_VENV)/bin/pip install -q -c $(FLOORS_VENV)/floors.txt -e '.[test]'
	$(FLOORS_VENV)/bin/pip list 2>/dev/null | grep -iE "^(jax|jaxlib|optax|orbax-checkpoint|numpy|tyro|sentencepiece) "
	$(FLOORS_VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist worksteal $(FLOOR_TESTS) $(ARGS)

# libtpu's ahead-of-time compiler, on this CPU host: the dense and MoE steps for a v5p-8.
test-tpu: $(VENV)/.installed  ## compile the training steps for a TPU slice here (installs the tpu extra)
	$(PY) -m pip install -q -e '.[tpu]'
	$(PY) -m pytest tests/test_dense.py tests/test_moe.py tests/test_compile_tpu.py \
	  -k "compile_topology or tpu_slice" $(ARGS)

# One TPU host from a fresh clone, no venv: each side's packages into BENCH_DEPS/ours and
# BENCH_DEPS/maxtext (pip --target, after the host's JAX on PYTHONPATH) from the host's index,
# INDEX=url, and/or WHEELS=dir (alone: no index read). bench/tpu.py's head says what it runs.
BENCH_DEPS ?= .bench-tpu
BENCH_OUT  ?= runs/bench-tpu
TPU_PIP     = --deps $(BENCH_DEPS) $(if $(WHEELS),--wheels $(WHEELS)) $(if $(INDEX),--index $(INDEX))
bench-tpu:  ## ours vs MaxText 0.2.5 on this host's TPU chip, alternating: one table (ROWS SIDES STEPS REPEATS PRINT=1)
	$(PYTHON) bench/tpu.py $(TPU_PIP) --out $(BENCH_OUT) $(if $(ROWS),--rows $(ROWS)) \
	  $(if $(SIDES),--sides $(SIDES)) $(if $(STEPS),--steps $(STEPS)) \
	  $(if $(REPEATS),--repeats $(REPEATS)) $(if $(PRINT),--print) $(ARGS)

# In one process (a TPU takes one program at a time); JAX_PLATFORMS left to JAX, which picks the
# accelerator (tests/conftest.py would set cpu). Without one, each test says why it skips.
test-chip:  ## tests/test_chip.py on this host's accelerator: splash, megablox, a step and a checkpoint vs the CPU
	$(PYTHON) bench/tpu.py $(TPU_PIP) --sides ours --install-only
	JAX_PLATFORMS= PYTHONPATH=$${PYTHONPATH:+$$PYTHONPATH:}$(abspath $(BENCH_DEPS))/ours \
	  $(PYTHON) -m pytest -p no:cacheprovider -m chip -rs tests/test_chip.py $(ARGS)

# Ahead-of-time compiles for TPU slices (libtpu, on this host), ours and MaxText's on the same
# models: memory per chip, XLA's FLOPs and estimated step time, the MFU it implies. docs/tpu.md.
compile-tpu: $(VENV)/.installed  ## per-chip memory, est. step time and MFU on TPU slices vs MaxText (compiled here)
	$(PY) -m pip install -q -e '.[tpu]'
	$(PY) bench/compile_tpu.py $(ARGS)

# MuonClip's reason to exist: tiny-deepseek (MLA, a dense first layer) under Muon at a learning
# rate where its attention logits run away, plain (a threshold no logit reaches only records
# them) and clipped at 100; both runs' largest logit and loss in one figure. docs/optimizers.md.
MUONCLIP := tiny-deepseek --train.optimizer muon --train.lr 0.05 --train.schedule wsd \
            --train.steps 120 --train.batch-size 8 --train.eval-every 1000
muonclip-demo: $(VENV)/.installed  ## Muon vs MuonClip on tiny-deepseek: runs/compare-muon-muonclip/max_logit.png
	@$(PY) -c 'import matplotlib' 2>/dev/null || $(PY) -m pip install -q matplotlib
	$(PY) train_moe.py $(MUONCLIP) --train.qk-clip-threshold 1e9 --run-dir runs/muon $(ARGS)
	$(PY) train_moe.py $(MUONCLIP) --train.qk-clip-threshold 100 --run-dir runs/muonclip $(ARGS)
	$(PY) -m tools.plot runs/muon runs/muonclip

bench: $(VENV)/.installed  ## tokens/s, ms/step, MFU and compile time of PRESET on synthetic tokens
	$(PY) train_dense.py $(PRESET) --bench 10 $(ARGS)

# A GPU venv of its own (the cuda extra's CUDA wheels are a few GB), so the CPU .venv stays as
# it is. bench/gpu.sh's head lists what else it reads: make bench-gpu BATCH=4 ATTN=cudnn ...
GPU_VENV   ?= .venv-gpu
GPU_EXTRAS ?= cuda
bench-gpu:  ## one NVIDIA GPU: cuda extra into GPU_VENV, bench llama3.2-1b (bf16, seq 4096) and tiny-moe
	VENV=$(GPU_VENV) EXTRAS=$(GPU_EXTRAS) PYTHON=$(PYTHON) bash bench/gpu.sh

bench-context: $(VENV)/.installed  ## ring, all-gather, Ulysses: tiny at seq 4096 split over 4 CPU devices
	$(PY) bench/context.py $(ARGS)

bench-pipeline: $(VENV)/.installed  ## GPipe vs circular: tiny (8 layers) over 2 and 4 stages of 8 CPU devices, ms/step
	$(PY) bench/pipeline.py $(ARGS)

bench-window: $(VENV)/.installed  ## Gemma's sliding window (256) vs every key: one attention layer at seq 2048
	$(PY) bench/window.py $(ARGS)

bench-moe: $(VENV)/.installed  ## tok/s and MFU of MOE_PRESET and of its dense twin (same active params), and their ratio
	$(PY) train_moe.py $(MOE_PRESET) --bench 10 $(ARGS)

# The peers (bench/peers/) install themselves on first use, each into its own venv under
# ~/.cache/jax-trainers (PEER_DIR overrides): MaxText needs Python 3.12, TRL brings torch.
bench-parity: $(VENV)/.installed  ## dense step vs MaxText 0.2.5 on the same model, alternating, medians + ratio
	$(PY) bench/parity.py $(ARGS)

bench-parity-moe: $(VENV)/.installed  ## MoE step vs MaxText 0.2.5's Mixtral block on the same model, medians + ratio
	$(PY) bench/parity.py --model moe $(ARGS)

bench-grpo: $(VENV)/.installed  ## one GRPO step (rollouts + update) vs TRL's GRPOTrainer, same model, medians + ratios
	$(PY) bench/grpo.py $(ARGS)

# One accelerator at a real size (bench/grpo_tpu.py): decode tok/s at 64 rows x 1024 new tokens,
# its share of the memory-bandwidth bound (copy bandwidth measured in the run), update MFU, twice.
bench-grpo-tpu: $(VENV)/.installed  ## GRPO on one chip: qwen3-0.6b decode tok/s, share of the bandwidth bound, update MFU
	$(PY) bench/grpo_tpu.py $(ARGS)

bench-recovery: $(VENV)/.installed  ## seconds from a kill -9 to the first step of the restarted group; checkpoint overhead
	$(PY) bench/recovery.py --preset $(PRESET) $(ARGS)

bench-scale: $(VENV)/.installed  ## prepare MB/s and peak memory (1 vs 2 workers), tiny ms/step from gs:// vs disk
	$(PY) bench/scale.py $(ARGS)

dry-run: $(VENV)/.installed  ## compile llama3.1-70b on 256 simulated devices and print its memory
	XLA_FLAGS=--xla_force_host_platform_device_count=256 $(PY) train_dense.py llama3.1-70b \
	  --dry-run --mesh.fsdp 256 $(ARGS)

prepare: $(VENV)/.installed  ## tokenize your own text: make prepare ARGS="--input my.txt --out data/mine"
	$(PY) -m common.data prepare $(ARGS)

# Before the venv is built: a forgotten RUN= should cost nothing.
need-run:
	@test -n "$(RUN)" || { echo 'usage: make $(MAKECMDGOALS) RUN=runs/tiny   (compare: RUN="runs/a runs/b")'; exit 2; }

plot: need-run $(VENV)/.installed  ## PNGs of a run's metrics.jsonl into RUN/plots; RUN="a b" compares runs; ARGS=--log-y
	@$(PY) -c 'import matplotlib' 2>/dev/null || $(PY) -m pip install -q matplotlib
	$(PY) -m tools.plot $(RUN) $(ARGS)

# One run: --logdir, so the profile plugin (which ignores --logdir_spec) shows its traces too.
# Several: each under its own name, for scalars side by side. Installs on first use (~400 MB
# with the profile plugin, so not part of any extra).
tensorboard: need-run $(VENV)/.installed  ## TensorBoard (scalars, config, profiles) on RUN at localhost:PORT
	@$(PY) -c 'import tensorboard, tensorboard_plugin_profile' 2>/dev/null || \
	  $(PY) -m pip install -q tensorboard tensorboard-plugin-profile
	$(PY) -m tensorboard.main --port $(PORT) $(if $(word 2,$(RUN)),--logdir_spec \
	  $(subst $() ,$(comma),$(foreach r,$(RUN),$(notdir $(patsubst %/,%,$(r))):$(r))),--logdir $(RUN)) $(ARGS)


# TASKS: lm-eval task names, comma-separated (nextline: ours, evals/); ARGS=--include-path DIR
# for task YAMLs whose data are on this machine (docs/eval.md). Results: RUN/eval/<task>.json.
# The run's own trainer scores it: TRAINER=train_moe.py for an MoE run.
TASKS ?= nextline
eval: $(VENV)/.installed  ## score RUN (default runs/tiny) with lm-evaluation-harness on TASKS: RUN/eval/<task>.json
	@$(PY) -c 'import lm_eval' 2>/dev/null || $(PY) -m pip install -q -e '.[eval]'
	$(PY) $(TRAINER) eval --run-dir $(or $(RUN),runs/tiny) --tasks $(TASKS) $(ARGS)

export-hf: $(VENV)/.installed  ## a run's checkpoint as a HuggingFace folder: make export-hf ARGS="--run-dir runs/tiny --out hf/tiny"
	$(PY) train_dense.py export-hf $(ARGS)

# HF: a HuggingFace folder (default: a tiny one made here); DATA: chat JSONL ({"messages": ...}).
HF      ?= hf/tiny-chat
DATA    ?= data/chat-demo.jsonl
FT_RUN  ?= runs/finetune-hf
FT_OUT  ?= $(FT_RUN)/hf
# The tiny random model learns from scratch: a pretrained one's 2e-5 would teach it nothing.
FT_DEMO := $(if $(filter hf/tiny-chat,$(HF)),--train.lr 3e-3 --train.seq-len 128 --train.steps 150)
finetune-hf: $(VENV)/.installed  ## SFT of HF on DATA with its chat template, then export-hf to FT_OUT
	@test "$(HF)" != hf/tiny-chat -o -d hf/tiny-chat || $(PY) tools/tiny_hf.py --out hf/tiny-chat --data data/chat-demo.jsonl
	$(PY) train_dense.py hf-sft --init-from-hf $(HF) --data.path $(DATA) --run-dir $(FT_RUN) $(FT_DEMO) $(ARGS)
	@if [ -e $(FT_OUT)/config.json ]; then echo "$(FT_OUT) exists: kept (FT_OUT=... exports again)"; \
	else $(PY) train_dense.py export-hf --run-dir $(FT_RUN) --out $(FT_OUT) --dtype bfloat16; fi

hf-fixtures: $(VENV)/.installed  ## remake tests/fixtures/hf with torch + transformers (installs the parity extra)
	$(PY) -m pip install -q -e '.[parity]'
	$(PY) tests/make_hf_fixtures.py

clean:  ## remove the virtual environment (runs/ and data/ are yours: never touched)
	rm -rf $(VENV)

# ---- Many machines: each target prints the real commands (make echoes them) and runs them.
# `make -n TARGET VAR=...` shows them without running. The same script runs everywhere
# (TRAINER: train_dense.py, train_moe.py or train_grpo.py, with one of its PRESETs); only the
# mesh flags and the launcher change. Data for many hosts: --data.path gs://bucket/prefix.
TRAINER    ?= train_dense.py
PROJECT    ?= my-gcp-project
ZONE       ?= us-east5-a
TPU_NAME   ?= jax-trainers
TPU_TYPE   ?= v5p-32
TPU_RUNTIME ?= v2-alpha-tpuv5
NUM_SLICES ?= 2
# Every process of a run must see RUN_DIR: on several hosts, a gs:// bucket (what a TPU pod
# uses: RUN_DIR=gs://my-bucket/runs/8b) or a shared mount (Filestore, NFS).
RUN_DIR    ?= runs/$(PRESET)
REMOTE_DIR ?= jax-trainers
GPUS       ?= 8
NODES      ?= 2
GPU_ARGS   ?= --model.dtype bfloat16
TPU_REMOTE  = cd $(REMOTE_DIR) && python3 -m venv .venv && .venv/bin/pip install -q -e '.[tpu,gcs]' && \
  .venv/bin/python $(TRAINER) $(PRESET) --run-dir $(RUN_DIR) --mesh.fsdp -1
.PHONY: tpu-vm tpu-multislice gpu-node gpu-slurm

tpu-vm:  ## one TPU VM slice: copy the repo to every worker, install, train (PROJECT ZONE TPU_NAME)
	gcloud compute tpus tpu-vm scp --recurse --project=$(PROJECT) --zone=$(ZONE) --worker=all \
	  common $(TRAINER) pyproject.toml README.md $(TPU_NAME):$(REMOTE_DIR)
	gcloud compute tpus tpu-vm ssh $(TPU_NAME) --project=$(PROJECT) --zone=$(ZONE) --worker=all \
	  --command="$(TPU_REMOTE) $(ARGS)"

tpu-multislice:  ## NUM_SLICES TPU slices via queued resources, data parallel over the DCN
	gcloud compute tpus queued-resources create $(TPU_NAME) --project=$(PROJECT) --zone=$(ZONE) \
	  --node-prefix=$(TPU_NAME) --node-count=$(NUM_SLICES) --accelerator-type=$(TPU_TYPE) \
	  --runtime-version=$(TPU_RUNTIME)
	for i in $$(seq 0 $$(($(NUM_SLICES) - 1))); do \
	  gcloud compute tpus tpu-vm scp --recurse --project=$(PROJECT) --zone=$(ZONE) --worker=all \
	    common $(TRAINER) pyproject.toml README.md $(TPU_NAME)-$$i:$(REMOTE_DIR) && \
	  gcloud compute tpus tpu-vm ssh $(TPU_NAME)-$$i --project=$(PROJECT) --zone=$(ZONE) \
	    --worker=all --command="$(TPU_REMOTE) --mesh.dcn-data $(NUM_SLICES) $(ARGS)" & \
	done; wait

gpu-node: $(VENV)/.installed  ## one GPU node: GPUS processes, one per GPU, restarted as a group on failure
	$(PY) -m common.launch --nproc $(GPUS) --gpus -- $(PY) $(TRAINER) $(PRESET) \
	  --run-dir $(RUN_DIR) --mesh.fsdp -1 $(GPU_ARGS) $(ARGS)

gpu-slurm:  ## NODES x GPUS GPUs under Slurm (cluster/slurm_train.sbatch)
	sbatch --nodes=$(NODES) --ntasks-per-node=$(GPUS) --gpus-per-node=$(GPUS) \
	  cluster/slurm_train.sbatch $(TRAINER) $(PRESET) --run-dir $(RUN_DIR) --mesh.fsdp -1 $(GPU_ARGS) $(ARGS)
