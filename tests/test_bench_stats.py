"""The side-by-side benches' bookkeeping on logs recorded from real runs (tests/fixtures/bench/:
round 1 of the first `make bench-parity-moe` invocation in the README and round 3 of the first
`make bench-grpo`, MaxText's and TRL's logs cut to the lines read): the MoE bench model is the one MaxText counted, and
bench/stats.py takes the same statistic from either side's log. No timing is asserted."""
import os

import pytest

import train_moe as tm
from bench import parity, stats

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "bench")
# Read off the logs by hand: the 8th of the 15 sorted step times of steps 5-19 (MoE); the
# mean of the 5th and 6th of the 10 sorted values of steps 6-15 (GRPO; ours from the JSON).
OURS_MEDIAN, PEER_MEDIAN = 1.4292, 3.509
GRPO_OURS_S, GRPO_OURS_TOK_S = 0.11679261749986836, 20331.376829659774
GRPO_TRL_S, GRPO_TRL_TOK_S = (0.0861 + 0.0897) / 2, (26440.8 + 27758.5) / 2


def read(name: str) -> str:
    with open(os.path.join(FIXTURES, name)) as f:
        return f.read()


def test_moe_bench_preset_has_the_parameter_count_maxtext_printed():
    log = read("moe-maxtext.log")
    assert "number parameters: 0.030 billion" in log   # what MaxText's log line says
    assert parity.maxtext_params(log) == 30_025_984     # its exact count (TensorBoard summary)
    assert tm.count_params(tm.PRESETS["bench-parity-moe"][1].model) == 30_025_984
    assert parity.our_params("moe") == 30_025_984
    with pytest.raises(ValueError, match="printed 0.030 billion"):
        parity.maxtext_params(log.replace("parameters: 30025984", "parameters: 31025984"))


def test_both_sides_median_the_same_steps_after_warm_up():
    ours = stats.ours_step_seconds(read("moe-ours.log"))
    peer = stats.maxtext_step_seconds(read("moe-maxtext.log"))
    first, last = stats.WARMUP, stats.WARMUP + 14          # the bench's default: 15 steps
    assert sorted(ours) == list(range(1, last + 1))         # step 0: the untimed warm-up
    assert sorted(peer) == list(range(0, last + 1))         # step 0: MaxText's first (compiles)
    assert stats.median_over(ours, first, last) == OURS_MEDIAN
    assert stats.median_over(peer, first, last) == PEER_MEDIAN
    assert stats.tokens_per_s(peer, first, last, 8 * 256) == pytest.approx(2048 / PEER_MEDIAN)
    # Warm-up steps change nothing; a step missing from a log is an error, not a shorter range.
    assert stats.median_over(peer | {0: 1e3, 1: 1e3, 4: 1e3}, first, last) == PEER_MEDIAN
    with pytest.raises(ValueError, match=r"steps \[20\] missing"):
        stats.median_over(peer, first, last + 1)


def test_grpo_sides_median_step_time_and_rollout_throughput_alike():
    ours = read("grpo-ours-metrics.jsonl")
    trl = read("grpo-trl.log")
    first, last = stats.WARMUP + 1, stats.WARMUP + 10      # bench/grpo.py's default range
    o_s, t_s = stats.metrics_step_seconds(ours), stats.trl_step_seconds(trl)
    o_r = stats.metrics_step_seconds(ours, "rollout_tokens_per_s", 1.0)
    t_r = stats.trl_step_seconds(trl, "tok/s")
    assert sorted(o_s) == sorted(t_s) == sorted(o_r) == sorted(t_r) == list(range(1, last + 1))
    assert stats.median_over(o_s, first, last) == pytest.approx(GRPO_OURS_S)
    assert stats.median_over(t_s, first, last) == pytest.approx(GRPO_TRL_S)
    assert stats.median_over(o_r, first, last) == pytest.approx(GRPO_OURS_TOK_S)
    assert stats.median_over(t_r, first, last) == pytest.approx(GRPO_TRL_TOK_S)
    # The work each side's timed steps did (bench/grpo.py prints it): completion tokens, ours
    # the mean length x 128 rollouts, TRL's its rollout counts (summed by hand, steps 6-15).
    o_n = stats.metrics_step_seconds(ours, "completions/mean_length", 128)
    assert sum(o_n[s] for s in range(first, last + 1)) == 4379
    assert sum(stats.trl_step_seconds(trl, "rollout")[s] for s in range(first, last + 1)) == 6961


def test_a_log_without_step_lines_is_an_error():
    with pytest.raises(ValueError, match="completed step"):
        stats.maxtext_step_seconds("I1201 maxtext started\n")
    with pytest.raises(ValueError, match="step seconds"):
        stats.ours_step_seconds("bench | 800 tok/s\n")
    with pytest.raises(ValueError, match="holds 2 values"):
        stats.ours_step_seconds("bench | step seconds 1-3: 0.1 0.2\n")


def test_grpo_small_bench_model_is_the_same_on_both_sides(tmp_path):
    """`make bench-grpo ARGS='--size small'`: the exported folder TRL trains holds exactly the
    parameters ours counts (~27M), and ours accepts the flags that size passes."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import train_grpo as tg
    from bench import grpo
    cfg = grpo.config("small")
    ours = tg.count_params(cfg.model)
    assert 20e6 < ours < 30e6 and (cfg.grpo.max_new_tokens, cfg.grpo.beta) == (128, 0.04)
    grpo.export(cfg, str(tmp_path))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == ours
    cli = tg.cli(["tiny", *grpo.same_flags(cfg)])
    assert (cli.model, cli.grpo) == (cfg.model, cfg.grpo)


def test_ours_is_the_moe_step_not_its_dense_twin():
    """train_moe.py --bench times its dense twin after the MoE: the MoE's line is the row's (the
    chip's moe-2k row once read the twin's 203.8 ms for the MoE's 355.2)."""
    log = ("bench moe | step seconds 1-2: 0.3552 0.3554\n"
           "bench dense | step seconds 1-2: 0.2037 0.2038\n")
    assert stats.ours_step_seconds(log) == {1: 0.3552, 2: 0.3554}
    assert stats.ours_step_seconds("bench | step seconds 1-1: 0.86\n") == {1: 0.86}
