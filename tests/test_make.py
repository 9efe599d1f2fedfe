"""The cluster targets print well-formed commands (`make -n`), and the Slurm script parses."""
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARS = ["PROJECT=proj", "ZONE=zone-a", "TPU_NAME=pod", "TPU_TYPE=v5p-64", "NUM_SLICES=3",
        "RUN_DIR=/mnt/shared/run", "PRESET=llama3.1-8b", "GPUS=4", "NODES=2",
        "VENV=/nonexistent-venv"]


def dry(target, *overrides):
    r = subprocess.run(["make", "-n", "-B", target, *VARS, *overrides], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return " ".join(r.stdout.replace("\\\n", " ").split())


def test_tpu_vm():
    out = dry("tpu-vm")
    assert "gcloud compute tpus tpu-vm scp --recurse --project=proj --zone=zone-a --worker=all" in out
    assert "gcloud compute tpus tpu-vm ssh pod --project=proj --zone=zone-a --worker=all" in out
    assert "train_dense.py llama3.1-8b --run-dir /mnt/shared/run --mesh.fsdp -1" in out
    assert "pip install -q -e '.[tpu,gcs]'" in out  # gcs: a gs:// RUN_DIR, the pod's usual


def test_tpu_vm_with_the_run_in_a_bucket():
    out = dry("tpu-vm", "RUN_DIR=gs://my-bucket/runs/8b")
    assert "train_dense.py llama3.1-8b --run-dir gs://my-bucket/runs/8b --mesh.fsdp -1" in out


def test_tpu_multislice_sets_the_dcn_axis():
    out = dry("tpu-multislice")
    assert ("queued-resources create pod --project=proj --zone=zone-a --node-prefix=pod "
            "--node-count=3 --accelerator-type=v5p-64") in out
    assert "seq 0 $((3 - 1))" in out and "pod-$i" in out
    assert "--mesh.dcn-data 3" in out


def test_gpu_node_uses_the_launcher():
    out = dry("gpu-node")
    assert ("/nonexistent-venv/bin/python -m common.launch --nproc 4 --gpus -- "
            "/nonexistent-venv/bin/python train_dense.py llama3.1-8b --run-dir /mnt/shared/run "
            "--mesh.fsdp -1") in out


def test_gpu_slurm_and_its_script():
    out = dry("gpu-slurm")
    assert ("sbatch --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 cluster/slurm_train.sbatch "
            "train_dense.py llama3.1-8b --run-dir /mnt/shared/run") in out
    script = os.path.join(ROOT, "cluster", "slurm_train.sbatch")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    text = open(script).read()
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID=$SLURM_PROCID",
                "CUDA_VISIBLE_DEVICES=$SLURM_LOCALID"):
        assert var in text


def test_help_lists_every_target():
    r = subprocess.run(["make", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    for t in ("train", "test", "bench", "tpu-vm", "tpu-multislice", "gpu-node", "gpu-slurm"):
        assert f"make {t} " in r.stdout


@pytest.mark.parametrize("target", ["tpu-vm", "tpu-multislice", "gpu-node", "gpu-slurm"])
@pytest.mark.parametrize("trainer", ["train_dense.py", "train_moe.py", "train_grpo.py"])
def test_cluster_targets_launch_the_named_trainer(target, trainer):
    out = dry(target, f"TRAINER={trainer}", "PRESET=some-preset")
    others = {"train_dense.py", "train_moe.py", "train_grpo.py"} - {trainer}
    assert f"{trainer} some-preset" in out, out
    assert not any(o in out for o in others), out


def test_dpo_demo_writes_pairs_and_tunes_the_sft_model():
    out = dry("dpo")
    assert ("/nonexistent-venv/bin/python tools/sft_demo.py --dpo --out data/dpo-demo "
            "/nonexistent-venv/bin/python train_dense.py tiny-dpo") in out
