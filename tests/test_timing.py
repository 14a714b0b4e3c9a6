"""ops.bench.timing's CUPTI kernel time: device records split into calls at the marker kernel (on the CPU), and
the kernel time of torch and MAX kernels (on the GPU); the benchmarks' report and plot from a CSV; host time
from the pipelined runs; the issues' targets read from the reports (scripts/check_targets.py)."""

import datetime
import sys
from pathlib import Path

import pytest
import torch

from ops.bench import results
from ops.bench.reports import appended, kept_rows, kept_stamp, plot_forward, write_report
from ops.bench.results import stamp_commit
from ops.bench.timing import MARK_KERNEL, busy_us_per_call, measure, side_by_side
from ops.layernorm import layernorm_fwd

MARK = f"{MARK_KERNEL}(long)"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))


def test_calls_are_split_at_markers_and_overlaps_count_once() -> None:
    spans = [
        ("warm-up kernel", 0, 5_000),  # before the first marker: no timed call owns it
        (MARK, 10_000, 11_000),
        ("ln", 12_000, 14_500),
        (MARK, 20_000, 21_000),
        ("gemm", 22_000, 30_000),
        ("memset", 29_000, 31_000),  # overlaps the gemm: 1 us of it is new
        ("bias", 40_000, 40_500),
    ]
    assert busy_us_per_call(spans) == [2.5, 9.0 + 0.5]


def test_records_are_sorted_by_start_time_first() -> None:
    spans = [("b", 5_000, 6_000), (MARK, 0, 100), ("a", 1_000, 3_000), (MARK, 4_000, 4_100)]
    assert busy_us_per_call(spans) == [2.0, 1.0]


def test_a_call_with_no_recorded_work_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no device work"):
        busy_us_per_call([(MARK, 0, 100), ("a", 200, 300), (MARK, 400, 500)])


@pytest.fixture
def results_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The results folder in a temporary one."""
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    return tmp_path


def test_report_is_long_format_and_its_views_come_from_the_csv(results_dir: Path) -> None:
    """A table is stored one value per row with its run's GPU, commit and date; the Markdown and the plot are
    drawn from the CSV; the table reads back as written; another table of the family keeps its rows."""
    rows = [{"kind": "fwd", "impl": "torch", "dtype": "bfloat16", "M": 4, "H": 8, "GBps": 10.5},
            {"kind": "fwd", "impl": "ours", "dtype": "bfloat16", "M": 4, "H": 8, "GBps": None},
            {"kind": "fwd", "impl": "ours", "dtype": "float32", "M": 1, "H": 8, "GBps": 2.0},
            {"kind": "bwd", "impl": "torch", "dtype": "float16", "M": 4, "H": 8, "GBps": 3.0}]
    fields = ["kind", "impl", "dtype", "M", "H", "GBps"]
    write_report("bench_layernorm", rows, fields, "GPU: test; commit abc", "T", "note")
    lines = (results_dir / "layernorm.csv").read_text().splitlines()
    assert lines[0] == ",".join(results.FIELDS)
    today = datetime.date.today().isoformat()
    assert f"bench_layernorm,0,kind=fwd,torch,bfloat16,M=4;H=8,GBps,10.5,test,abc,{today}" in lines
    assert [line for line in lines if line.startswith("bench_layernorm,1,")] == [   # no value: a place holder
        f"bench_layernorm,1,kind=fwd,ours,bfloat16,M=4;H=8,,,test,abc,{today}"]
    assert "| fwd | ours | bfloat16 | 4 | 8 |  |" in (results_dir / "layernorm.md").read_text()
    write_report("bench_layernorm_bwd_sweep", [{"parts": 2, "us": 1.5}], ["parts", "us"], "GPU: test", "S", "n")
    rows[1]["GBps"] = 12.0
    write_report("bench_layernorm", rows, fields, "GPU: test; commit abc", "T", "note")
    stamp, back = results.read_table("bench_layernorm")
    assert stamp == "GPU: test; commit abc" and back[1] == {k: str(v) for k, v in rows[1].items()}
    assert results.read_table("bench_layernorm_bwd_sweep")[1] == [{"parts": "2", "us": "1.5"}]
    md = (results_dir / "layernorm.md").read_text()
    assert md.index("## S") < md.index("## T")   # the sweep's table, then the rewritten one
    # forward rows only, one panel per dtype, impls in the order asked and only where the table has them
    drawn = plot_forward("bench_layernorm", "t", "GBps", "GB/s", ("M", "H"), "{}x{}", ("ours", "copy", "torch"))
    assert drawn == {"bfloat16": ["ours", "torch"], "float32": ["ours"]}
    assert (results_dir / "layernorm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="^table:"):
        results.family_of("bench_nothing")


def test_appended_report_keeps_the_other_dtypes_rows_and_their_stamp(results_dir: Path) -> None:
    """A run of one dtype appended to an earlier report keeps the other dtypes' rows, with their own run's commit
    and date, and its stamp names the earlier report's, so each row's commit stays known."""
    table = "bench_layernorm"
    assert kept_rows(table, {"bfloat16"}) == [] and kept_stamp(table) == ""
    rows = [{"dtype": "float32", "us": 2.0}, {"dtype": "bfloat16", "us": 1.0}]
    write_report(table, rows, ["dtype", "us"], "GPU: test; commit aaa", "T", "note")
    assert kept_rows(table, {"bfloat16"}) == [{"dtype": "float32", "us": "2.0"}]
    assert kept_stamp(table) == "; rows of other dtypes kept from: GPU: test; commit aaa"
    new = [{"dtype": "bfloat16", "us": 0.5}]
    rows, kept = appended(table, "bfloat16", new)
    assert (rows, kept) == ([{"dtype": "float32", "us": "2.0"}] + new,
                            " (bfloat16 rows); rows of other dtypes kept from: GPU: test; commit aaa")
    write_report(table, rows, ["dtype", "us"], f"GPU: test; commit bbb{kept}", "T", "note")
    runs = {(r["dtype"], r["commit"]) for r in results.read_long("layernorm") if r["metric"] == "us"}
    assert runs == {("float32", "aaa"), ("bfloat16", "bbb")}


def test_transformer_report_keeps_other_modes_rows_with_their_commit(results_dir: Path) -> None:
    """A transformer run of some modes keeps the other modes' rows, its stamp names the run they came from
    (keyed by mode), and check_targets counts each mode's rows at its own run's commit."""
    import check_targets

    fields = ["mode", "phase", "tokens", "impl", "vs_torch"]
    first = [{"mode": m, "phase": "train", "tokens": "4096", "impl": "ours", "vs_torch": v}
             for m, v in (("eager", 0.9), ("cuda_graph", 0.96))]
    write_report("bench_transformer", first, fields, "GPU: g; commit a1", "T", "note")
    rerun = [{"mode": "eager", "phase": "train", "tokens": "4096", "impl": "ours", "vs_torch": 0.8}]
    rows, kept = appended("bench_transformer", "eager", rerun, column="mode")
    assert kept == " (eager rows); rows of other modes kept from: GPU: g; commit a1"
    write_report("bench_transformer", rows, fields, f"GPU: g; commit b2; medians over 5 processes{kept}", "T", "n")
    stamp, rows = results.read_table("bench_transformer")
    assert [stamp_commit(stamp, m) for m in ("eager", "cuda_graph")] == ["b2", "a1"]
    found = {c.target: c for c in check_targets.transformer_checks(stamp, rows)}
    assert (found["transformer eager train / torch's"].value, found["transformer eager train / torch's"].commit) \
        == (0.8, "b2")
    assert (found["transformer cuda_graph train / torch's"].value,
            found["transformer cuda_graph train / torch's"].commit) == (0.96, "a1")
    assert appended("bench_transformer_control", "eager", rerun, column="mode") == (rerun, "")


def test_models_rerun_of_some_models_keeps_the_others_rows_of_its_mode(results_dir: Path) -> None:
    """bench_models run for some models of a mode replaces those models' rows of it alone: the other models' rows of
    that mode and the other modes' rows stay, each counted at its own run's commit by check_targets (labels
    "mode/model"), through two such reruns."""
    import check_targets

    fields = ["model", "mode", "phase", "impl", "tokens", "vs_hf"]

    def row(model: str, mode: str, impl: str, v: float) -> dict:
        return {"model": model, "mode": mode, "phase": "infer", "impl": impl, "tokens": "4096", "vs_hf": v}
    first = [row(m, mode, "ours", v) for m, mode, v in (("llama", "eager", 0.81), ("opt", "eager", 0.97),
                                                         ("llama", "compile", 1.01))]
    write_report("bench_models", first, fields, "GPU: g; commit a1", "T", "note")
    rows, kept = appended("bench_models", "eager", [row("opt", "eager", "ours", 0.94)], "mode", ("model", "opt"))
    assert [(r["model"], r["mode"], float(r["vs_hf"])) for r in rows] == [
        ("llama", "eager", 0.81), ("llama", "compile", 1.01), ("opt", "eager", 0.94)]
    assert kept == " (eager/opt rows); rows of other modes kept from: GPU: g; commit a1"
    write_report("bench_models", rows, fields, f"GPU: g; commit b2{kept}", "T", "note")
    rows, kept = appended("bench_models", "eager", [row("llama", "eager", "ours", 0.8)], "mode", ("model", "llama"))
    write_report("bench_models", rows, fields, f"GPU: g; commit c3{kept}", "T", "note")
    stamp, rows = results.read_table("bench_models")
    assert [stamp_commit(stamp, key) for key in (("eager", "opt"), ("eager", "llama"), ("compile", "llama"))] == \
        ["b2", "c3", "a1"]
    found = {c.target: c for c in check_targets.models_checks(stamp, rows)}
    assert [(found[f"{m} eager infer / unpatched Hugging Face model's"].value,
             found[f"{m} eager infer / unpatched Hugging Face model's"].commit) for m in ("opt", "llama")] == \
        [(0.94, "b2"), (0.8, "c3")]
    assert found["llama compile infer / unpatched Hugging Face model's"].commit == "a1"


def test_rows_rerun_by_kind_keep_their_own_commit_in_the_csv(results_dir: Path) -> None:
    """A report rerun for some kinds (values with a '+', as "add+rms_norm") stamps only those rows with the new
    commit: in the stamp, in each CSV row's commit column, and for check_targets' keys (dtype, kind)."""
    table, fields = "bench_rmsnorm", ["kind", "impl", "dtype", "us"]
    first = [{"kind": k, "impl": "ours", "dtype": "bfloat16", "us": 1.0} for k in ("fwd", "add+rms_norm")]
    write_report(table, first, fields, "GPU: g; commit a1", "T", "note")
    rows, kept = appended(table, "add+rms_norm", [{**first[1], "us": 2.0}], column="kind")
    write_report(table, rows, fields, f"GPU: g (read+write); commit b2{kept}", "T", "note")
    stamp = results.read_table(table)[0]
    assert [stamp_commit(stamp, ("bfloat16", k)) for k in ("fwd", "add+rms_norm")] == ["a1", "b2"]
    commits = {r["case"]: r["commit"] for r in results.read_long("rmsnorm") if r["row"] != ""}
    assert commits == {"kind=fwd": "a1", "kind=add+rms_norm": "b2"}


def test_each_dtypes_commit_is_the_newest_run_that_wrote_it(results_dir: Path) -> None:
    """Reruns of some dtypes chain their stamps; each dtype's commit is the newest run's that names it (a run
    of two dtypes names both), and runs that no kept row came from drop out of the chain."""
    table = "bench_layernorm_linear"
    rows = [{"dtype": d, "us": 1.0} for d in ("float32", "float16", "bfloat16")]
    write_report(table, rows, ["dtype", "us"], "GPU: g; commit a1", "T", "note")
    for commit, dtypes in (("b2", "float32,float16"), ("c3", "bfloat16"), ("d4", "float32")):
        new = [{"dtype": d, "us": 2.0} for d in dtypes.split(",")]
        rows, kept = appended(table, dtypes, new)
        write_report(table, rows, ["dtype", "us"], f"GPU: g; commit {commit}{kept}", "T", "note")
    stamp = results.read_table(table)[0]
    assert [stamp_commit(stamp, d) for d in ("float32", "float16", "bfloat16")] == ["d4", "b2", "c3"]
    assert "a1" not in stamp and stamp.count("commit") == 3, stamp   # a1's rows were all rewritten
    assert stamp_commit("GPU: g; commit e5", "float32") == "e5" and stamp_commit("GPU: g", "float32") == "?"


@pytest.mark.gpu
def test_kernel_time_on_the_gpu_counts_torch_and_max_kernels() -> None:
    x = torch.randn(4096, 4096, device="cuda")
    y = torch.empty_like(x)
    copy = measure(lambda a, b: b.copy_(a), [(x, y)], iters=10, kernels=True)
    assert 0 < copy.kernel_us <= 1.05 * copy.device_us
    twice = measure(lambda a, b: (b.copy_(a), b.copy_(a)), [(x, y)], iters=10, kernels=True)
    assert 1.8 * copy.kernel_us < twice.kernel_us < 2.2 * copy.kernel_us
    w, b = torch.ones(4096, device="cuda"), torch.zeros(4096, device="cuda")
    ln = measure(lambda *a: layernorm_fwd(*a)[0], [(x, w, b)], iters=10, kernels=True)  # runs on MAX's queue
    assert 0.5 * ln.device_us < ln.kernel_us <= 1.05 * ln.device_us


def test_parse_shape_takes_sizes_and_names_the_flag() -> None:
    from ops.bench.reports import parse_shape

    assert parse_shape("4096x768x3072", 3) == (4096, 768, 3072)
    assert parse_shape("1X7", 2) == (1, 7)
    for bad in ("4096x768", "4096x0x8", "axbxc", "4096,768,3072", ""):
        with pytest.raises(SystemExit, match="^--shape: expected 3 positive sizes"):
            parse_shape(bad, 3)


def _bench_rows(kind: str, cases: dict[str, dict[str, float]], **key: str) -> list[dict[str, str]]:
    return [{"kind": kind, "impl": impl, "dtype": "bfloat16", **key, **{c: str(v) for c, v in cols.items()}}
            for impl, cols in cases.items()]


def test_targets_are_the_worst_row_and_a_miss_is_a_miss() -> None:
    """scripts/check_targets.py: each target is its worst row against the issue's limit, so one row over the
    limit fails it; the strided budget is ours plus the strided copy."""
    import check_targets

    stamp = "GPU: H100; commit abc1234"
    fast = {"torch": {"pipe_us": 30, "host_us": 20, "us": 20}, "ours": {"pipe_us": 24, "host_us": 25, "us": 10}}
    slow_host = {"torch": {"pipe_us": 30, "host_us": 20, "us": 20}, "ours": {"pipe_us": 24, "host_us": 31, "us": 10}}
    strided = {"ours": {"pipe_us": 10}, "copy:strided": {"pipe_us": 20}, "ours:strided": {"pipe_us": 33}}
    rows = (_bench_rows("fwd", fast, M="1", H="256") + _bench_rows("fwd", slow_host, M="2", H="256")
            + _bench_rows("fwd-strided", strided, M="4096", H="768"))
    host, big, small, copy = check_targets.layernorm_checks(stamp, rows)
    assert (host.value, host.where, host.commit, host.met) == (1.55, "fwd bfloat16 2x256", "abc1234", False)
    assert big.met and big.value == 0.8 and small.value is None and not small.met   # no rows: not met
    assert copy.value == 1.1 and not copy.met
    train = [{"mode": "cuda_graph", "phase": "train", "tokens": t, "impl": "ours", "vs_torch": v}
             for t, v in (("128", "0.9"), ("4096", "0.96"))]
    graph_train = [c for c in check_targets.transformer_checks(stamp, train) if "cuda_graph train" in c.target]
    assert [(c.value, c.where, c.met) for c in graph_train] == [(0.96, "4096 tokens", False)]


def test_device_time_ab_goes_stale_with_the_launch() -> None:
    """check_targets counts the same-GPU A/B only while the working tree launches what it timed as "new" and
    the kernel source is its commit's or builds the forwards it timed to the same PTX (a commit not in the
    repository counts as changed)."""
    import check_targets

    from ops.layernorm import config as layernorm_config

    launch = layernorm_config.fwd_launch(32, 8192, torch.float32, True)
    key, row = ("fwd", "ours", "float32", "32", "8192"), {"new_kernel": f"{launch.kernel}{list(launch.params)}"}
    assert check_targets.ab_moved({key: row}) is None
    moved = check_targets.ab_moved({key: {"new_kernel": "ln_fwd_loop[16, 1, 4]"}})
    assert moved == f"fwd ours float32 32x8192 launches {launch.kernel}{list(launch.params)} now"
    gone = check_targets.ab_stale("GPU: H100; commit 0000000; against 0306017", {key: row})
    assert gone == "commit 0000000 is not in this repository"


def test_host_time_is_part_of_the_pipelined_time() -> None:
    """Host time comes from the pipelined runs (until the last call returned), so it is never more than the
    pipelined time; side_by_side gives every contender both."""
    sets = [(torch.randn(64, 256),)]
    t = measure(torch.nn.functional.gelu, sets, iters=5)
    assert 0 < t.host_us <= t.pipelined_us
    both = side_by_side([("a", torch.nn.functional.gelu, sets), ("b", torch.tanh, sets)], iters=5)
    assert all(0 < x.host_us <= x.pipelined_us for x in both.values())


def test_transformer_medians_over_processes() -> None:
    """bench_transformer --processes: the median ms per contender, and the median of each process's own ratio (not
    the ratio of medians, which would compare times from different processes), with those ratios' range."""
    import bench_transformer

    def rows(torch_ms: float, ours_ms: float) -> list[dict]:
        return [{"mode": "eager", "phase": "infer", "tokens": 128, "impl": impl, "ms": ms, "tokens_per_s": 0,
                 "vs_torch": round(ms / torch_ms, 3)} for impl, ms in (("torch", torch_ms), ("ours", ours_ms))]

    got = {r["impl"]: r for r in bench_transformer.process_medians([rows(4.0, 4.4), rows(3.0, 2.85), rows(3.2, 3.1)])}
    assert (got["torch"]["ms"], got["torch"]["vs_torch"]) == (3.2, 1.0)
    assert (got["ours"]["ms"], got["ours"]["vs_torch"], got["ours"]["tokens_per_s"]) == (3.1, 0.969, 41290)
    assert (got["ours"]["vs_torch_min"], got["ours"]["vs_torch_max"]) == (0.95, 1.1)   # the processes' range


def test_transformer_timing_is_stamped_and_passed_to_each_process() -> None:
    """bench_transformer's Timing: the stamp says how the rows were timed (processes, rounds unless the default,
    the pinned CPU) after the commit that check_targets reads, and a --processes run hands each process the flags
    that time its rows the same way."""
    import bench_transformer as bt

    pinned = bt.Timing(processes=5, repeats=31, pin_core=4)
    assert pinned.flags() == ["--repeats", "31", "--pin-core", "4"]
    assert pinned.stamp().endswith("; medians over 5 processes; 31 rounds; every thread pinned to CPU 4 while timed")
    assert stamp_commit(pinned.stamp(), "compile") == stamp_commit(bt.Timing().stamp(), "compile") != "?"
    assert bt.Timing().flags() == ["--repeats", str(bt.REPEATS)]
    assert "pinned" not in bt.Timing().stamp() and "rounds" not in bt.Timing().stamp()


def test_pipelined_runs_rotate_the_order() -> None:
    """Each round starts with the next contender (A B C, B C A, C A B), so none always goes first or after the
    same other; every contender gets every round's run."""
    from ops.bench.timing import pipelined_runs

    order: list[str] = []
    fns = {name: (lambda name=name: order.append(name)) for name in "abc"}
    got = pipelined_runs(fns, calls=1, repeats=4, device="cpu")
    assert "".join(order) == "abcbcacababc" and set(got) == set("abc")


def test_pinned_threads_pin_every_thread_and_restore_them() -> None:
    """pinned_threads puts every thread of the process (one started before the block, one started inside) on the one
    core, then gives each back the CPUs it had; a core the process may not use is a named error; None pins nothing."""
    import os
    import threading

    from ops.bench.timing import pinned_threads

    allowed = os.sched_getaffinity(0)
    core = max(allowed)
    seen: dict[str, set[int]] = {}
    go, done = threading.Event(), threading.Event()

    def worker() -> None:
        go.wait()
        seen["before"] = os.sched_getaffinity(0)
        done.set()

    before = threading.Thread(target=worker)
    before.start()
    with pinned_threads(core):
        inside = threading.Thread(target=lambda: seen.__setitem__("inside", os.sched_getaffinity(0)))
        inside.start()
        inside.join()
        go.set()
        done.wait()
        seen["main"] = os.sched_getaffinity(0)
    before.join()
    assert seen == {"before": {core}, "inside": {core}, "main": {core}}
    assert os.sched_getaffinity(0) == allowed
    with pytest.raises(ValueError, match="pin core: expected one of this process's CPUs"):
        with pinned_threads(max(allowed) + 1000):
            pass
    with pinned_threads(None):
        assert os.sched_getaffinity(0) == allowed


def test_paired_ratio_is_the_median_of_each_rounds_ratio() -> None:
    """paired_ratio divides run by run within each round, so a round where the host was slow for both contenders
    gives the same ratio as a fast one; runs of different calls (or none) are refused."""
    from ops.bench.timing import Pipelined, paired_ratio

    torch_runs, ours_runs = (10.0, 20.0, 10.0, 30.0, 10.0), (9.0, 18.0, 9.5, 27.0, 12.0)
    a, b = Pipelined(9.5, 0.0, ours_runs), Pipelined(10.0, 0.0, torch_runs)
    assert paired_ratio(a, b) == 0.9   # of 0.9, 0.9, 0.95, 0.9, 1.2; the medians' ratio would say 0.95
    with pytest.raises(ValueError, match="runs of one pipelined_runs call"):
        paired_ratio(a, Pipelined(10.0, 0.0, torch_runs[:4]))
    with pytest.raises(ValueError, match="runs of one pipelined_runs call"):
        paired_ratio(Pipelined(9.5, 0.0), b)


def test_transformer_compile_contenders_set_every_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_transformer's compile A/B contenders: each call sets its own knob to its value and every other knob to
    the default, so "ours" runs the defaults whichever contender ran before."""
    import bench_transformer as bt

    from ops.layernorm import config as layernorm_config
    from ops.layernorm_linear import config as layernorm_linear_config

    for ab in bt.COMPILE_ABS.values():
        monkeypatch.setattr(ab.config, ab.knob, ab.default)
    seen = {}

    def knobs() -> tuple[object, ...]:
        c = layernorm_linear_config
        return (layernorm_config.COMPILED_LAYERNORM, c.COMPILED_TRAINING_LINEAR, c.COMPILED_TRAINING_LAYERNORM_LINEAR,
                c.COMPILED_LINEAR_GELU)
    for impl in (*bt.COMPILE_ABS, "ours"):
        bt.with_compile_knobs(impl, lambda impl=impl: seen.__setitem__(impl, knobs()))()
    ln, linear, ln_linear, gelu = knobs()
    assert seen == {"ours_ln_op": ("ours", linear, ln_linear, gelu), "ours_cpp_linear": (ln, "ours", ln_linear, gelu),
                    "ours_ln_linear_op": (ln, linear, "ours", gelu),
                    "ours_inductor_form": (ln, linear, "inductor", gelu),
                    "ours_no_gelu_epilogue": (ln, linear, ln_linear, False), "ours": (ln, linear, ln_linear, gelu)}
    assert gelu is True and ln_linear == "auto"


def test_ptx_fingerprint_sees_code_not_names() -> None:
    """scripts/compare_ptx.py: PTX that differs only in our mangled names and comments is the same kernel; one
    changed instruction is not."""
    import compare_ptx

    ptx = ("// generated by Mojo\n.visible .entry kernels_layernorm_ln_fwd_loop6A6AcB_0123456789abcdef(\n"
           "  .param .u64 kernels_layernorm_ln_fwd_loop6A6AcB_0123456789abcdef_param_0\n)\n"
           "{\n  add.f32 %f1, %f2, %f3;\n}\n")
    renamed = ptx.replace("ln_fwd_loop6A6AcB_0123456789abcdef", "fwd_loop_shifted6A6AcB_fedcba9876543210")
    assert compare_ptx.fingerprint(renamed) == compare_ptx.fingerprint(ptx)
    assert compare_ptx.fingerprint("// another comment\n" + ptx) == compare_ptx.fingerprint(ptx)
    assert compare_ptx.fingerprint(ptx.replace("add.f32", "sub.f32")) != compare_ptx.fingerprint(ptx)


def test_call_fields_carry_the_repeat_statistics() -> None:
    """A row's headline carries how many pipelined runs its median is over and their spread; a timing without
    runs leaves the spread empty (its row stores no value for it)."""
    from ops.bench.timing import Timing, call_fields

    ours = Timing(5.0, 4.0, 50, pipelined_us=10.0, pipelined_runs=(9.0, 10.0, 12.5))
    torch_t = Timing(5.0, 4.0, 50, pipelined_us=20.0)
    assert call_fields(ours, torch_t) == {"pipe_us": 10.0, "host_us": 4.0, "pipe_vs_torch": 0.5, "pipe_runs": 3,
                                          "pipe_spread": 0.35}
    assert call_fields(torch_t, torch_t)["pipe_spread"] is None
