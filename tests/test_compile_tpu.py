"""bench/compile_tpu.py (`make compile-tpu`) and the dry run's XLA cost analysis it reads:
the rows, the arithmetic of the table, the subprocess plumbing, and on the CPU the cost keys
that common/train.py dry_run reports. The TPU compile itself needs libtpu (skipped without)."""
import json
import math
import subprocess
import sys

import pytest

import train_dense as td
from bench import compile_tpu as ct
from common import train
from tests.spawn import scatter_loops
from tests.test_dense import _has_libtpu

LLAMA_2K = ct.parse_row(ct.ROWS[0])
# The llama3.1-8b step cut to 4 layers at 2048 tokens, by hand (train_dense.flops_per_token's
# formula): 4 layers of q, k, v, o, gate, up, down, the unembedding, attention's two products.
_PER_LAYER = 4096 * 32 * 128 * 2 + 2 * 4096 * 8 * 128 + 3 * 4096 * 14336
_FWD = 2 * (4 * _PER_LAYER + 4096 * 128256) + 2 * 2 * 4 * 2048 * 32 * 128
LLAMA_2K_FLOPS = 3 * _FWD * 4 * 2048   # 4 chips x 1 sequence x 2048 tokens


def test_builtin_rows_parse_and_name_their_chips_and_peak():
    rows = [ct.parse_row(s) for s in ct.ROWS]
    assert len({r["name"] for r in rows}) == len(rows)
    assert (LLAMA_2K["chips"], LLAMA_2K["peak"]) == (4, 459e12)   # v5p-8: 2 cores a chip
    by = {r["name"]: r for r in rows}
    assert by["llama70b-8k"]["chips"] == 128 and by["gemma3-12b"]["chips"] == 8
    assert by["gemma3-12b"]["peak"] == 918e12
    assert by["deepseek-v3"]["ours"] == "--model.first-k-dense 1 --model.mtp-depth 0"  # whole


@pytest.mark.parametrize("spec,says", [
    ("name=a trainer=dense preset=tiny topology=v5p-8 batch=1 seq=256", "missing layers"),
    ("name=a trainer=dense preset=tiny topology=v5p-8 batch=1 seq=256 layers=2 size=3", "size=3"),
    ("name=a trainer=dense preset=tiny topology=v5p-8 batch=0 seq=256 layers=2", "batch"),
    ("name=a trainer=dense preset=tiny topology=v5p-8 batch=1 seq=2k layers=2", "'2k'"),
    ("name=a trainer=gpt preset=tiny topology=v5p-8 batch=1 seq=256 layers=2", "'gpt'"),
    ("name=a trainer=dense preset=tiny topology=v9-8 batch=1 seq=256 layers=2", "'v9-8'"),
    ("name=a trainer=dense preset=tiny topology=v5p-1 batch=1 seq=256 layers=2", "one v5p chip"),
    ("name=a name=b trainer=dense preset=tiny topology=v5p-8 batch=1 seq=256 layers=2", "twice"),
    ("name=a ours='--x", "quotation"),
])
def test_a_bad_row_says_what_is_wrong(spec, says):
    with pytest.raises(ct.RowError) as e:
        ct.parse_row(spec)
    assert says in str(e.value)


def test_rows_are_selected_by_name_in_order_and_an_unknown_name_lists_the_rows():
    rows = [ct.parse_row(s) for s in ct.ROWS]
    assert [r["name"] for r in ct.select(rows, "mixtral, llama8b-2k")] == ["mixtral",
                                                                          "llama8b-2k"]
    with pytest.raises(ct.RowError) as e:
        ct.select(rows, "llama8b-2k,llama-9b")
    assert "llama-9b" in str(e.value) and "gemma3-12b" in str(e.value)


def test_both_sides_get_the_same_model_shape_and_unrolled_layers():
    argv = ct.ours_argv(LLAMA_2K, "--model.remat dots")
    flag = lambda f: argv[argv.index(f) + 1]
    assert flag("--train.batch-size") == "4" and flag("--train.seq-len") == "2048"
    assert flag("--model.n-layers") == "4" and "--model.no-scan-layers" in argv
    assert argv[-2:] == ["--model.remat", "dots"]   # extra flags come last: they win
    theirs = ct.maxtext_args(LLAMA_2K)
    for kv in ("compile_topology=v5p-8", "model_name=llama3.1-8b", "per_device_batch_size=1",
               "max_target_length=2048", "base_num_decoder_layers=4", "scan_layers=false"):
        assert kv in theirs
    ds = ct.parse_row(ct.ROWS[4])
    assert "first_num_dense_layers=1" in ct.maxtext_args(ds)
    # like MaxText's (mtp_num_layers 0): no multi-token prediction module
    assert ct.ours_argv(ds)[-4:] == ["--model.first-k-dense", "1", "--model.mtp-depth", "0"]


def test_pipeline_rows_compile_two_slices_with_the_stage_axis_across_them_on_both_sides():
    rows = {r["name"]: r for r in map(ct.parse_row, ct.PIPELINE_ROWS)}
    gpipe = rows["pp-405b-gpipe"]
    assert (gpipe["chips"], gpipe["peak"]) == (8, 459e12)   # two v5p-8 slices of 4 chips
    flag = dict(zip(ct.ours_argv(gpipe), ct.ours_argv(gpipe)[1:]))   # the last one given wins
    assert flag["--compile-slices"] == "2" and flag["--train.batch-size"] == "16"
    assert flag["--mesh.dcn-stage"] == "2" and flag["--mesh.fsdp"] == "4"
    theirs = ct.maxtext_args(gpipe)
    for kv in ("compile_topology_num_slices=2", "per_device_batch_size=2",
               "dcn_pipeline_parallelism=2", "num_pipeline_microbatches=4",
               "num_layers_per_pipeline_stage=2"):   # 2 layers x 2 stages x 1 repeat: GPipe
        assert kv in theirs
    assert "num_layers_per_pipeline_stage=1" in ct.maxtext_args(rows["pp-405b-circular"])
    assert "compile_topology_num_slices=1" in ct.maxtext_args(LLAMA_2K)
    assert dict(zip(ct.ours_argv(LLAMA_2K), ct.ours_argv(LLAMA_2K)[1:]))["--compile-slices"] == "1"


def test_maxtext_compiles_with_the_libtpu_it_is_given_or_its_own(monkeypatch):
    monkeypatch.setitem(ct.ENV, "TPU_LIBRARY_PATH", "/ours/libtpu/libtpu.so")   # JAX sets it
    assert ct.maxtext_env("/x/libtpu/libtpu.so")["TPU_LIBRARY_PATH"] == "/x/libtpu/libtpu.so"
    assert "TPU_LIBRARY_PATH" not in ct.maxtext_env("")


def test_model_flops_are_the_trainers_count_of_the_cut_model():
    assert ct.model_flops_per_step(LLAMA_2K) == LLAMA_2K_FLOPS


def test_mfu_is_model_flops_over_est_time_over_the_slices_peak():
    assert ct.mfu(LLAMA_2K_FLOPS, 0.0622, 4, 459e12) == pytest.approx(
        LLAMA_2K_FLOPS / 0.0622 / (4 * 459e12))
    assert ct.mfu(LLAMA_2K_FLOPS, 0.0622, 4, 459e12) == pytest.approx(0.6305, abs=1e-4)
    assert math.isnan(ct.mfu(LLAMA_2K_FLOPS, None, 4, 459e12))


def _canned(**ours):
    return {"row": LLAMA_2K, "model_flops_per_step": LLAMA_2K_FLOPS,
            "ours": {"per_device_bytes": int(17.5 * 2**30), "xla_flops": 18.1e12,
                     "est_step_s": 0.0763, "compile_s": 66.0, "xla_while_loops": 0} | ours,
            "maxtext": {"per_device_bytes": int(8.75 * 2**30), "xla_flops": 19.8e12,
                        "est_step_s": 0.0709, "compile_s": 112.6, "xla_while_loops": 0}}


def test_table_shows_each_side_and_the_ratios():
    text = ct.table([_canned()])
    line = [ln for ln in text.splitlines() if ln.startswith("| llama8b-2k")][0]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[4] == "17.50 / 8.75"                                    # GiB per chip
    assert cells[5] == "18.1 / 19.8"                                     # XLA TFLOP per chip
    assert cells[6] == f"{18.1e12 * 4 / LLAMA_2K_FLOPS:.2f} / {19.8e12 * 4 / LLAMA_2K_FLOPS:.2f}"
    assert cells[6] == "1.01 / 1.10"
    assert cells[7] == "0.0763 / 0.0709"
    mfu_o, mfu_m = (100 * LLAMA_2K_FLOPS / s / (4 * 459e12) for s in (0.0763, 0.0709))
    assert cells[8] == f"{mfu_o:.1f}% / {mfu_m:.1f}%"
    assert cells[10] == f"{0.0763 / 0.0709:.2f}" and cells[11] == "2.00"
    assert len(cells) == text.splitlines()[0].count("|") - 1


def test_table_names_a_failure_and_a_loop_counted_once():
    bad = _canned()
    bad["maxtext"] = {"error": "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm",
                      "wall_s": 30.0}
    text = ct.table([bad, _canned(xla_while_loops=2)])
    assert "0.0763 / -" in text and "| - | - |" in text                 # no ratio without both
    assert "| 66 / 30 (failed) |" in text                                # compile seconds
    assert "llama8b-2k, MaxText: RESOURCE_EXHAUSTED" in text
    assert "llama8b-2k, ours: 2 while loop(s)" in text
    no_est = _canned()
    del no_est["ours"]["est_step_s"]
    assert "llama8b-2k, ours: XLA gave no step time" in ct.table([no_est])


def test_run_one_reads_the_report_line_and_says_why_a_compile_failed(tmp_path):
    ok = ct.run_one([sys.executable, "-c", "print('noise'); print('REPORT {\"x\": 1}')"],
                    "REPORT ", str(tmp_path / "ok.log"), timeout=60)
    assert ok["x"] == 1 and ok["wall_s"] > 0
    assert "noise" in (tmp_path / "ok.log").read_text()
    oom = ct.run_one([sys.executable, "-c", "import sys; print('a'); sys.exit("
                      "'jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: 120G of 95G hbm')"],
                     "REPORT ", str(tmp_path / "oom.log"), timeout=60)
    assert oom["error"].startswith("jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED")
    slow = ct.run_one([sys.executable, "-c", "import time; time.sleep(30)"], "REPORT ",
                      str(tmp_path / "slow.log"), timeout=1)
    assert "timed out after 1 s" in slow["error"]


class _Compiled:
    def __init__(self, cost, text="ENTRY main {}"):
        self.cost, self.text = cost, text

    def cost_analysis(self):
        if isinstance(self.cost, Exception):
            raise self.cost
        return self.cost

    def as_text(self):
        return self.text


@pytest.mark.parametrize("cost,want", [
    ({"flops": 10.0, "bytes accessed": 4.0, "optimal_seconds": 0.5, "utilization0{}": 1.0},
     {"xla_flops": 10.0, "xla_bytes_accessed": 4.0, "est_step_s": 0.5, "xla_while_loops": 0}),
    ([{"flops": 10.0}], {"xla_flops": 10.0, "xla_while_loops": 0}),           # older JAX
    ({"flops": 10.0, "optimal_seconds": -1.0}, {"xla_flops": 10.0, "xla_while_loops": 0}),
    (None, {}), ([], {}), (NotImplementedError("no cost model"), {}), ({}, {}),
])
def test_xla_cost_takes_every_shape_cost_analysis_returns(cost, want):
    assert train.xla_cost(_Compiled(cost)) == want


def test_xla_cost_counts_while_loops():
    text = "%w = (s32[]) while(%t), condition=%c, body=%b\n %v = f32[] while(%u), body=%d"
    assert train.xla_cost(_Compiled({"flops": 1.0}, text))["xla_while_loops"] == 2


def test_dry_run_reports_xla_cost_on_the_cpu():
    """XLA:CPU gives FLOPs and bytes (no modelled time). Unrolled, with the loss in one chunk,
    the step has no loop, and its FLOPs over the devices are the model's plus remat's
    recomputed forward: between 1x and 1.5x the trainer's own count. Scanned, the layer
    stack is a loop whose body is counted once."""
    flat = td.main(td.cli(["tiny", "--dry-run", "--mesh.fsdp", "8", "--model.no-scan-layers",
                           "--quiet"]))
    cfg = td.cli(["tiny"])
    model = td.flops_per_token(cfg.model, cfg.train.seq_len) * cfg.train.batch_size * \
        cfg.train.seq_len
    assert flat["xla_while_loops"] == scatter_loops() and flat["xla_bytes_accessed"] > 0
    assert 1.0 < flat["xla_flops"] * flat["devices"] / model < 1.5
    assert flat.get("est_step_s", 1.0) > 0
    scanned = td.main(td.cli(["tiny", "--dry-run", "--mesh.fsdp", "8", "--quiet"]))
    assert scanned["xla_while_loops"] >= 1 + scatter_loops()
    assert scanned["xla_flops"] < 0.6 * flat["xla_flops"]   # 1 of tiny's 4 layers counted


def test_maxtext_wrapper_refuses_words_that_are_not_overrides():
    out = subprocess.run([sys.executable, ct.os.path.join(ct.PEER, "maxtext_compile.py"),
                          "v5p-8"], capture_output=True, text=True)
    assert out.returncode and "key=value" in out.stderr


@pytest.mark.skipif(not _has_libtpu(), reason="ahead-of-time TPU compilation needs libtpu "
                    "(pip install -e '.[tpu]'): `make test-tpu`, a leg of .ci/run")
def test_our_compile_for_a_tpu_slice_reports_an_estimated_step(tmp_path):
    row = ct.parse_row("name=t trainer=dense preset=tiny topology=v5p-8 batch=2 seq=256 "
                       "layers=2")
    report = ct.compile_ours(row, "", str(tmp_path), timeout=600, dumps=("schedule",))
    assert "error" not in report, report
    assert report["devices"] == 4 and report["platform"] == "tpu"
    assert report["est_step_s"] > 0 and report["xla_flops"] > 0
    assert report["xla_while_loops"] == 0 and report["versions"]["libtpu"]
    json.dumps(report)
    # --schedule: libtpu's scheduler wrote the step's timeline, which bench/schedule.py reads
    from bench import schedule
    timeline = schedule.read(str(tmp_path / "t.ours.dump"))
    assert timeline["span_s"] > 0 and timeline["by_opcode"]["fusion"][1] > 0
    notes = ct.schedule_notes([{"row": row, "ours": report}], str(tmp_path))
    assert len(notes) == 1 and f"{timeline['span_s']:.4f} / - s" in notes[0], notes


def test_schedule_reads_the_entry_computations_last_timeline(tmp_path):
    """bench/schedule.py on a dump written here: the entry's instructions by opcode, in seconds
    at the file's clock; a rerun of the scheduler (a second timeline) replaces the first, and
    another computation's timeline is not the step's."""
    from bench import schedule

    def inst(i, name, op):
        return ["    instructions {", f'      name: "{name}"',
                f'      opcode: "{op}"', "      shape {", "        element_type: F32", "      }",
                f"      id: {i}", "    }"]

    def timeline(comp, *spans):
        return (["computation_schedules {", f"  computation_id: {comp}"]
                + [line for i, a, b in spans for line in (
                    "  instructions {", f"    id: {i}", f"    start_timestamp_cycles: {a}",
                    f"    end_timestamp_cycles: {b}", "  }")] + ["}"])
    text = (["hlo_module {", '  name: "jit_train_step"', '  entry_computation_name: "main"',
             "  computations {", '    name: "body"'] + inst(1, "add.1", "add")
            + ["    id: 7", "  }", "  computations {", '    name: "main"']
            + inst(2, "fusion.3", "fusion") + inst(3, "all-gather.4", "all-gather")
            + inst(4, "fusion.5", "fusion") + ["    id: 9", "  }", "}"]
            + timeline(7, (1, 0, 5e9))
            + timeline(9, (2, 0, 1750), (3, 1750, 2625), (4, 2625, 7000))   # replaced below
            + timeline(9, (2, 0, 1750), (3, 1750, 5250), (4, 5250, 7000))[:-1]
            + ["  cycles_per_microsecond: 1750", "}"])
    (tmp_path / "jit_train_step.schedule.txt").write_text("\n".join(text))
    got = schedule.read(str(tmp_path))
    assert got["span_s"] == pytest.approx(4e-6)
    assert got["by_opcode"] == {"fusion": (pytest.approx(2e-6), 2),
                                "all-gather": (pytest.approx(2e-6), 1)}
    assert got["top"][0][1:] == ("all-gather", "all-gather.4")


def test_hlo_bytes_counts_what_each_top_level_instruction_reads_and_writes():
    """bench/hlo_bytes.py on a module written here: parameters move nothing, a fusion counts
    its operands and output once (not the instructions inside it), and each row names the JAX
    op that made it."""
    from bench import hlo_bytes as hb
    text = "\n".join([
        "HloModule m", "",
        "%fused (p0: f32[4,8]) -> f32[4,8] {",
        "  %p0 = f32[4,8]{1,0} parameter(0)",
        "  ROOT %mul = f32[4,8]{1,0} multiply(%p0, %p0)",
        "}", "",
        "ENTRY %main (a: f32[4,8], b: bf16[16]) -> f32[4,8] {",
        "  %a = f32[4,8]{1,0} parameter(0)",
        "  %b = bf16[16]{0} parameter(1)",
        '  %c = f32[16]{0} convert(%b), metadata={op_name="jit(step)/convert_element_type"}',
        "  ROOT %f = f32[4,8]{1,0} fusion(%a), kind=kLoop, calls=%fused, "
        'metadata={op_name="jit(step)/jvp()/mul"}',
        "}"])
    rows = {r["name"]: r for r in hb.instructions(text)}
    assert set(rows) == {"c", "f"}
    assert rows["c"]["bytes"] == 16 * 4 + 16 * 2 and rows["f"]["bytes"] == 2 * 4 * 8 * 4
    assert rows["f"]["op"] == "fusion:kLoop" and hb.source(rows["f"]["source"]) == "mul"


@pytest.mark.parametrize("mem", [
    lambda b: 34.4 + 7.0 * b ** 0.85,   # llama3.1-8b at 8k on v5p-8: slower than linear
    lambda b: 10.0 + 3.0 * b,
    lambda b: 90.0 + 0.5 * b,
    lambda b: 10.0 + 80.0 * b,           # batch 1 fits, 2 does not
    lambda b: 120.0 + b,                 # nothing fits
    lambda b: None if b > 5 else 10.0 + b,   # compiles fail (taken as not fitting) above 5
])
def test_fit_finds_the_largest_batch_under_the_hbm_in_a_few_compiles(mem):
    def fits(b):
        return mem(b) is not None and mem(b) <= 95
    want = max([b for b in range(1, 257) if all(fits(c) for c in range(1, b + 1))], default=0)
    got, seen = ct.largest_batch(mem, 95.0)
    assert got == want, seen
    # Five compiles where each reports its memory; a failing range is halved (log2 of 256).
    assert len(seen) <= (5 if None not in seen.values() else 10), seen
    assert want == 0 or (fits(want) and want + 1 in seen and not fits(want + 1)) or want == 256


def test_fit_rows_are_the_models_whole_and_the_chips_hbm_is_known():
    rows = [ct.parse_row(s) for s in ct.FIT_ROWS]
    assert [r["layers"] for r in rows] == [32, 80] and {r["seq"] for r in rows} == {8192}
    assert [ct.hbm_gib(r["topology"]) for r in rows] == [95.73, 95.73]
    assert ct.hbm_gib("v6e-8") == 32


def test_fit_compiles_each_side_scanned_and_tables_its_largest_batch(monkeypatch, tmp_path):
    calls = []

    def ours(row, extra, *a, **k):
        calls.append(("ours", row["batch"], extra))
        return {"per_device_bytes": (30 + 4 * row["batch"]) * ct.GIB, "wall_s": 1.0}

    def theirs(row, extra, *a, **k):
        calls.append(("maxtext", row["batch"], extra))
        if row["batch"] > 8:
            return {"error": "RESOURCE_EXHAUSTED: CompileTimeHbmOom", "wall_s": 1.0}
        return {"per_device_bytes": (30 + 6 * row["batch"]) * ct.GIB, "wall_s": 1.0}
    monkeypatch.setattr(ct, "compile_ours", ours)
    monkeypatch.setattr(ct, "compile_maxtext", theirs)
    args = ct.argparse.Namespace(ours_flags="", maxtext_flags="", log_dir=str(tmp_path),
                                 timeout=1, json=str(tmp_path / "fit.json"))
    out = ct.fit_rows([ct.parse_row(ct.FIT_ROWS[0])], args, "python", "")
    # ours: 30 + 4b <= 95.73 up to b = 16; MaxText: 30 + 6b up to 10, refused above 8
    assert "| 16 (94.00) | 8 (78.00) | 2.00 |" in out, out
    assert all("--model.scan-layers" in e for s, _, e in calls if s == "ours")
    assert all("scan_layers=true" in e for s, _, e in calls if s == "maxtext")
    saved = json.load(open(tmp_path / "fit.json"))["fit"]["llama8b-8k-fit"]
    assert saved["ours"]["largest"] == 16 and saved["MaxText"]["largest"] == 8


def test_fit_refuses_a_chip_without_an_hbm_figure_before_compiling(monkeypatch):
    monkeypatch.setattr(ct, "HBM_GIB", {"v5p": 95.73})
    monkeypatch.setattr(ct, "compile_ours", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises(SystemExit) as e:
        ct.main(["--fit", "--no-maxtext", "--row", "name=x trainer=dense preset=tiny "
                 "topology=v6e-8 batch=1 seq=256 layers=2"])
    assert "v6e-8" in str(e.value) and "no HBM figure" in str(e.value)
