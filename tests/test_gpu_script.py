"""bench/gpu.sh (`make bench-gpu`) on a machine without a GPU: it parses, its two bench
commands are flags the trainers accept with the values asked for, and it stops with a clear
message, non-zero, before anything is benchmarked: at once without a driver, and after the
install step (a venv that already holds everything: no pip) when JAX sees no GPU.

The venv the script is pointed at is a fresh one without pip whose site-packages lead to this
interpreter's: the script's reuse check runs for real, and whatever it decided it could never
write into the venv the suite runs from (PIP_NO_INDEX too keeps pip from fetching anything).
"""
import os
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu.sh")
# The script's settings: none may leak in from the caller's environment.
SETTINGS = ("PYTHON", "VENV", "EXTRAS", "INSTALL", "BATCH", "SEQ", "ATTN", "REMAT", "STEPS",
            "CHECK_STEPS",
            "PEAK_TFLOPS", "DENSE_ARGS", "MOE_ARGS", "LOG_DIR", "NVIDIA_SMI", "DRY_RUN",
            "CUDA_VISIBLE_DEVICES", "XLA_FLAGS")
NO_GPU = "no NVIDIA GPU visible to JAX: jax.devices() = [CpuDevice(id=0)]; this script needs one"


def gpu_sh(tmp_path, timeout=60, **settings):
    """Run the script from a directory that is not the repository's; JAX on the CPU only."""
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    env.update(JAX_PLATFORMS="cpu", PIP_NO_INDEX="1", LOG_DIR=str(tmp_path / "logs"), **settings)
    return subprocess.run(["bash", SCRIPT], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def venv_like_this_one(tmp_path):
    """A venv without pip that sees this interpreter's packages (jax, the test extra)."""
    venv = tmp_path / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv",
                    "--without-pip", str(venv)], check=True, timeout=60)
    site = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    ours = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    with open(os.path.join(site, "this-interpreter.pth"), "w") as f:
        f.writelines(f"import site; site.addsitedir({p!r})\n" for p in sorted(ours))
    return venv


@pytest.fixture
def fake_nvidia_smi(tmp_path):
    """An nvidia-smi that lists one GPU: the driver check passes, JAX's then fails."""
    path = tmp_path / "nvidia-smi"
    path.write_text('#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-fake)"\n')
    path.chmod(0o755)
    return path


def test_bash_parses_it():
    r = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    head = open(SCRIPT).read()
    assert "set -euo pipefail" in head
    for var in ("VENV", "EXTRAS", "INSTALL", "BATCH", "ATTN", "PEAK_TFLOPS"):  # documented
        assert f"#   {var} " in head, var


def test_without_a_driver_it_stops_before_installing(tmp_path):
    r = gpu_sh(tmp_path, NVIDIA_SMI=str(tmp_path / "no-such-nvidia-smi"),
               VENV=str(tmp_path / "venv"))
    assert r.returncode == 3, r.stdout + r.stderr
    assert "no NVIDIA GPU" in r.stderr and "this script needs one" in r.stderr
    assert not (tmp_path / "venv").exists()          # nothing installed
    assert not (tmp_path / "logs").exists() and "tok/s" not in r.stdout


def test_a_driver_that_lists_no_gpu_stops_it_too(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    smi.chmod(0o755)
    r = gpu_sh(tmp_path, NVIDIA_SMI=str(smi), VENV=str(tmp_path / "venv"))
    assert r.returncode == 3 and "No devices were found" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "venv").exists()


def test_without_a_gpu_for_jax_it_stops_before_benchmarking(tmp_path, venv_like_this_one,
                                                            fake_nvidia_smi):
    r = gpu_sh(tmp_path, NVIDIA_SMI=str(fake_nvidia_smi), VENV=str(venv_like_this_one),
               EXTRAS="test")
    out = r.stdout + r.stderr
    assert r.returncode == 3, out
    assert "NVIDIA H100 80GB HBM3" in r.stdout                  # nvidia-smi's view, first
    assert "reusing" in r.stdout and "no pip" in r.stdout       # the venv held everything
    assert NO_GPU in r.stderr and "JAX_PLATFORMS=cpu" in r.stderr, r.stderr
    assert "train_dense.py" not in out and "train_moe.py" not in out and "tok/s" not in out
    assert not (tmp_path / "logs").exists()


def test_an_extra_the_project_lacks_is_named(tmp_path, venv_like_this_one, fake_nvidia_smi):
    r = gpu_sh(tmp_path, NVIDIA_SMI=str(fake_nvidia_smi), VENV=str(venv_like_this_one),
               EXTRAS="cuda,gpu")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no extra ['gpu'] in pyproject.toml" in r.stderr


@pytest.mark.parametrize("bad", [{"BATCH": "0"}, {"STEPS": "ten"}, {"INSTALL": "maybe"},
                                 {"CHECK_STEPS": "-1"},
                                 {"PEAK_TFLOPS": "989 TFLOP/s"}])
def test_a_bad_setting_is_refused(tmp_path, bad):
    r = gpu_sh(tmp_path, **bad)
    (name, value), = bad.items()
    assert r.returncode == 2 and f"{name}={value}" in r.stderr, r.stdout + r.stderr


def commands(tmp_path, **settings):
    r = gpu_sh(tmp_path, DRY_RUN="1", **settings)
    assert r.returncode == 0, r.stderr
    dense, moe = r.stdout.splitlines()
    return dense.split(), moe.split()


def test_the_bench_commands_are_what_the_trainers_accept(tmp_path):
    import train_dense as td
    import train_moe as tm
    dense, moe = commands(tmp_path)
    assert dense[:3] == [".venv-gpu/bin/python", "train_dense.py", "llama3.2-1b"]
    cfg = td.cli(dense[2:])
    m, t = cfg.model, cfg.train
    assert (m.dtype, t.seq_len, t.batch_size, m.attention, m.remat, cfg.bench) == (
        "bfloat16", 4096, 8, "auto", "full", 10)
    assert t.peak_tflops == 0  # the table in common/train.py
    td.validate(cfg, 1)        # every check that needs no compilation, on one device
    assert moe[:3] == [".venv-gpu/bin/python", "train_moe.py", "tiny-moe"]
    assert tm.cli(moe[2:]).bench == 10

    dense, moe = commands(tmp_path, BATCH="4", ATTN="cudnn", SEQ="2048", STEPS="5",
                          PEAK_TFLOPS="500", DENSE_ARGS="--train.lr 1e-4", VENV="/v")
    cfg = td.cli(dense[2:])
    assert (cfg.train.batch_size, cfg.model.attention, cfg.train.seq_len, cfg.bench,
            cfg.train.peak_tflops, cfg.train.lr, dense[0]) == (4, "cudnn", 2048, 5, 500, 1e-4,
                                                                "/v/bin/python")
    td.validate(cfg, 1)
    c = tm.cli(moe[2:])
    assert (c.bench, c.train.peak_tflops) == (5, 500)


def test_make_bench_gpu_runs_the_script_with_a_venv_of_its_own():
    # Under `make test`, the outer make's variables (PYTHON=..., in MAKEFLAGS) would reach this one.
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTHON", "GPU_VENV", "GPU_EXTRAS")}

    def dry(*overrides):
        r = subprocess.run(["make", "-n", "bench-gpu", *overrides], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()
    assert dry() == "VENV=.venv-gpu EXTRAS=cuda PYTHON=python3 bash bench/gpu.sh"
    assert dry("GPU_VENV=/x", "GPU_EXTRAS=cuda,test") == \
        "VENV=/x EXTRAS=cuda,test PYTHON=python3 bash bench/gpu.sh"
    r = subprocess.run(["make", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "make bench-gpu " in r.stdout


def test_the_kernel_check_needs_a_gpu_and_can_fail(monkeypatch):
    """bench/gpu_check.py: without a GPU, exit 3 before any case; its comparison passes the
    blocked kernel (what `attend` runs here) and fails a kernel that drops the window."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_check.py")],
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 3 and "no GPU visible to JAX" in r.stderr, r.stdout + r.stderr
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu_check
    from common import attention as A
    kind, errs = gpu_check.case(256, 4, 2, 64, 64, dict(window=64))
    assert kind == "cudnn" and max(errs) <= gpu_check.TOL / 2, errs
    windowless = A.attend
    monkeypatch.setattr(A, "attend", lambda *a, window=0, **kw: windowless(*a, **kw))
    _, errs = gpu_check.case(256, 4, 2, 64, 64, dict(window=64))
    assert max(errs) > 10 * gpu_check.TOL, errs
