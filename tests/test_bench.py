"""--bench and --dry-run of every trainer, on tiny models: the figures are printed and reported
(their values are never asserted: timings here are noise), and an accelerator missing from
the peak table reads "MFU unknown" instead of dividing by zero."""
import dataclasses
import math

import jax
import numpy as np
import pytest

import train_dense as td
import train_grpo as tg
import train_moe as tm
from common import train

DENSE = td.Config(model=td.ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4,
                                       n_kv_heads=2, head_dim=8, d_ff=64, loss_chunk=16),
                  train=td.TrainConfig(batch_size=8, seq_len=32, peak_tflops=1.0))
MOE = tm.Config(model=tm.ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4,
                                     n_kv_heads=2, head_dim=8, n_experts=4, top_k=2, d_ff=32,
                                     loss_chunk=16),
                train=tm.TrainConfig(batch_size=8, seq_len=32, peak_tflops=1.0))
GRPO = tg.Config(model=dataclasses.replace(tg.PRESETS["tiny"][1].model, d_model=32, d_ff=64,
                                           head_dim=8),
                 grpo=tg.GRPOConfig(prompts_per_step=4, group_size=2, peak_tflops=1.0))


@pytest.mark.parametrize("mod, cfg", [(td, DENSE), (tm, MOE), (tg, GRPO)],
                         ids=["dense", "moe", "grpo"])
def test_bench_and_dry_run_report_their_figures(mod, cfg, capsys):
    report = mod.main(dataclasses.replace(cfg, bench=2))
    out = capsys.readouterr().out
    for r in [report["moe"], report["dense"]] if mod is tm else [report]:  # MoE: and its twin
        assert r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 and 0 < r["mfu"] < math.inf
    assert "tok/s" in out and "ms/step" in out and "MFU" in out and "compile" in out
    report = mod.main(dataclasses.replace(cfg, dry_run=True))
    assert report["params"] == mod.count_params(cfg.model) and report["devices"] == 8
    assert report["per_device_bytes"] > 0
    assert "per device:" in capsys.readouterr().out


def test_mfu_of_an_unknown_accelerator_reads_unknown(monkeypatch, capsys):
    class Device:  # what jax.devices() gives on hardware the peak table does not list
        device_kind, platform = "Some New Accelerator", "gpu"
    monkeypatch.setattr(jax, "devices", lambda *a: [Device()])
    peak = train.peak_flops_per_device(0.0)
    assert peak[0] == 0 and "--train.peak-tflops" in peak[1]
    monkeypatch.undo()
    monkeypatch.setattr(train, "peak_flops_per_device", lambda _: peak)
    report = td.main(dataclasses.replace(DENSE, bench=1))
    assert report["tokens_per_s"] > 0 and math.isnan(report["mfu"])
    assert "MFU unknown" in capsys.readouterr().out


def test_with_several_processes_only_process_0_measures_the_peak(monkeypatch):
    """Measured by every process at once, each would see a share of the host's cores (MFU
    read 205-246% over 2 processes): process 1 waits for process 0's figure instead."""
    from jax.experimental import multihost_utils
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(jax, "jit", lambda *a, **k: pytest.fail("process 1 measured"))
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", lambda x: np.float32(2**39))
    peak, src = train.peak_flops_per_device(0.0)
    assert peak == 2**39 / jax.device_count() and "host 550 GFLOP/s" in src
