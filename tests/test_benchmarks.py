"""The benchmarks as programs: what they write (their JSON lines and results files, never their wording), the
padding arithmetic, the statistics their ratios are, and the GPU check's driver and plan. No test here asserts
a time; the tests that build a model are slow.

The GPU check's CPU rehearsal (python benchmarks/gpu_check.py --tiny) takes many minutes, so it is not a test:
docs/performance.md gives its command and its last times."""
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
from support import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


def _rows(lengths, prompt=4):
    return [([1] * prompt, [2] * n) for n in lengths]


def _results(folder):
    """The one results file a run wrote into folder: (its header, its JSON lines, its end)."""
    record = load_script("benchmarks/record.py")
    files = os.listdir(folder)
    assert len(files) == 1, files
    return record.read(os.path.join(folder, files[0]))


# ---- results files --------------------------------------------------------------------------------

def test_a_results_file_starts_with_its_provenance_and_ends_with_whether_it_finished(tmp_path, capsys):
    """record.kept: the file is named <machine>-<commit>-<script>-<time>.txt, its first line is the provenance
    (the commit, the dirty flag, the CPU, its cores, the GPU, torch, the command), then every line the run
    printed, and last whether it finished; a run that raised says so, and its error. Breaks if the header is not
    the first line, if a printed line is lost, or if a failed run's file reads as a finished one."""
    record = load_script("benchmarks/record.py")
    with record.kept(str(tmp_path / "ok"), "demo") as path:
        print(json.dumps({"phase": "x", "seconds": 1.5}))
        print("| a table | row |")
    assert capsys.readouterr().out.count('"phase": "x"') == 1  # the terminal still gets it
    header, rows, end = record.read(path)
    assert header["results"] == "demo" and set(header["provenance"]) == {
        "commit", "dirty", "cpu", "cores", "gpu", "torch", "command"}
    prov = header["provenance"]
    assert os.path.basename(path).startswith(f"{record.machine(prov)}-{prov['commit'][:7]}")
    assert re.fullmatch(r"[a-z0-9]+-\d+c-[0-9a-f]{7}(-dirty)?-demo-\d{8}-\d{6}\.txt", os.path.basename(path))
    assert rows == [{"phase": "x", "seconds": 1.5}] and end["finished"] is True
    assert "| a table | row |" in open(path).read()
    with pytest.raises(ZeroDivisionError):
        with record.kept(str(tmp_path / "failed"), "demo"):
            print(json.dumps({"phase": "y"}))
            1 / 0
    header, rows, end = _results(tmp_path / "failed")
    assert rows == [{"phase": "y"}] and end["finished"] is False and "ZeroDivisionError" in end["error"]
    with record.kept("none", "demo") as nothing:
        assert nothing is None


def test_timed_keeps_a_commands_time_its_exit_and_its_output(tmp_path):
    """benchmarks/timed.py (the README's times of bash toy.sh and bash test.sh): the command's output is kept in
    the results file, then one JSON line with its seconds, its exit code and the load around it; its exit code
    is the command's. Breaks if a failed command's time reads as a success, or its output is lost."""
    for code in (0, 3):
        folder = tmp_path / str(code)
        proc = subprocess.run([sys.executable, os.path.join(BENCH, "timed.py"), "--label", "demo", "--results",
                               str(folder), "--", sys.executable, "-c", f"print('hello'); raise SystemExit({code})"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == code, proc.stderr
        header, rows, end = _results(folder)
        assert header["results"] == "time-demo" and end["finished"] is True
        assert [set(r) for r in rows] == [{"label", "command", "seconds", "exit", "load_before", "load_after"}]
        assert rows[0]["exit"] == code and rows[0]["label"] == "demo" and rows[0]["seconds"] >= 0
        assert "hello" in open(os.path.join(folder, os.listdir(folder)[0])).read()


def test_a_machine_is_named_for_its_gpu_else_its_cpu_and_cores():
    """The results files' first word. Breaks if two machines' files can share a name (a GPU's run named for its
    host CPU, or two CPUs' core counts dropped)."""
    record = load_script("benchmarks/record.py")
    assert record.machine({"gpu": "NVIDIA H200", "cpu": "AMD EPYC 9B14", "cores": 16}) == "h200"
    assert record.machine({"gpu": "NVIDIA H100 80GB HBM3", "cpu": "x", "cores": 26}) == "h100"
    assert record.machine({"gpu": None, "cpu": "AMD EPYC 9B14", "cores": 2}) == "epyc-2c"
    assert record.machine({"gpu": None, "cpu": "Intel(R) Xeon(R) Processor", "cores": 2}) == "xeon-2c"


def test_vs_trls_columns_are_the_pair_whose_ratio_is_printed():
    """vs_trl.py's ratio is the median of the per-pair ratios, and its step columns are that median pair's, so
    TRL step / stapo step is the printed ratio (issue 60: the columns' 0.286/0.294 = 0.97 beside a bold 1.02x).
    Breaks if the columns are each side's median over runs while the ratio is the median of pair ratios."""
    vs = load_script("benchmarks/vs_trl.py")
    run = lambda s, mb: {"step_s": s, "peak_mb": mb}  # noqa: E731
    pairs = [(run(0.40, 835), run(0.35, 514)), (run(0.20, 800), run(0.30, 500)), (run(0.30, 820), run(0.20, 509))]
    x = vs.summary(pairs)  # the pair ratios 1.14, 0.67, 1.5; each side's median step is 0.30: 1.00
    assert x["trl_over_stapo"] == pytest.approx(0.40 / 0.35) and x["pair_ratios"] == pytest.approx(
        [0.40 / 0.35, 0.20 / 0.30, 0.30 / 0.20])
    assert (x["trl_step_s"], x["stapo_step_s"]) == (0.40, 0.35)  # the median pair's: they give the ratio
    assert x["stapo_over_trl_peak"] == pytest.approx(514 / 835)
    x = vs.summary(pairs[:2])  # an even count: the lower of the middle two, one pair's own
    assert (x["trl_step_s"], x["stapo_step_s"]) == (0.20, 0.30) and x["trl_over_stapo"] == pytest.approx(0.2 / 0.3)


# ---- train_passes.py: the lengths and the padding ------------------------------------------------------

def test_the_long_tail_is_seeded_and_clipped_and_a_file_is_read(tmp_path):
    tp = load_script("benchmarks/train_passes.py")
    a, b = (tp.response_lengths("lognormal", 500, 1024, 1.0, 0) for _ in range(2))
    assert a == b != tp.response_lengths("lognormal", 500, 1024, 1.0, 1)
    assert min(a) == 200 and max(a) == 8192 and 700 < sorted(a)[250] < 1500  # clipped both ends; median 1,024
    assert tp.response_lengths("equal", 3, 77, 1.0, 0) == [77, 77, 77]
    (tmp_path / "lengths.jsonl").write_text('{"response_len": 5}\n{"tokens": [1, 2, 3]}\n\n7\n')
    assert tp.response_lengths(str(tmp_path / "lengths.jsonl"), 5, 0, 1.0, 0) == [5, 3, 7, 5, 3]


def test_padding_counts_each_micro_batch_at_its_longest():
    tp = load_script("benchmarks/train_passes.py")
    rows = _rows([6, 16, 16], prompt=4)  # sequences of 10, 20, 20
    assert tp.padding(rows, [[0, 1, 2]]) == (1 - 50 / 60, 60)
    assert tp.padding(rows, [[0], [1, 2], None]) == (0.0, 50)


def test_the_padding_only_rule_is_policy_micro_batches(monkeypatch, capsys):
    """--padding-only computes two cuts without a process group (policy.cut_by_length): the trainer's, checked
    against policy.micro_batches itself, and the fewest micro-batches that fit, checked against a count by
    hand; on a long tail (the number the issue asks about) the trainer's cut makes more micro-batches, with
    less padding."""
    import policy
    tp = load_script("benchmarks/train_passes.py")
    monkeypatch.setattr(policy, "all_reduce_numbers", lambda *xs, op=None: list(xs))  # a world of one
    lengths = tp.response_lengths("lognormal", 64, 1024, 1.0, 3)
    rows = tp.make_rows(64, 256, lengths, 100, 1)
    idx = policy.shortest_first(rows, range(64))
    args = type("A", (), {"micro_tokens": 16384})
    tp.print_padding(rows, idx, args, "lognormal")
    printed = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["grouping"] for x in printed] == ["trainers_cut", "fewest_micro_batches"]
    groups = [idx[part] for part, idle in policy.micro_batches(rows, idx, 16384) if not idle]
    want = tp.padding(rows, groups)
    assert (printed[0]["padded_frac"], printed[0]["tokens_computed"], printed[0]["micro_batches"]) == (
        round(want[0], 4), want[1], len(groups))
    n, fewest, tokens = [policy.length(rows[i]) for i in idx], 0, 0
    while tokens < len(n):  # greedy: each micro-batch as long as fits, the fewest there are
        end = tokens + 1
        while end < len(n) and (end + 1 - tokens) * n[end] <= 16384:
            end += 1
        fewest, tokens = fewest + 1, end
    assert printed[1]["micro_batches"] == fewest < printed[0]["micro_batches"]
    assert printed[0]["padded_frac"] < printed[1]["padded_frac"]


def test_the_micro_batches_pad_at_most_a_tenth_of_a_long_tail(monkeypatch):
    """The issue's bound: on the benchmark's long tail (64 samples as one rank holds them, prompt 256,
    responses log-normal, median 1,024, 200..8,192; --micro-tokens 16384), at most 10% of the tokens the
    decoder computes are padding in the micro-batches the trainer cuts, on any device, for ten seeds."""
    import policy
    tp = load_script("benchmarks/train_passes.py")
    monkeypatch.setattr(policy, "all_reduce_numbers", lambda *xs, op=None: list(xs))  # a world of one
    for seed in range(10):
        rows = tp.make_rows(64, 256, tp.response_lengths("lognormal", 64, 1024, 1.0, seed), 100, 1)
        idx = policy.shortest_first(rows, range(64))
        parts = policy.micro_batches(rows, idx, 16384)
        padded, _ = tp.padding(rows, [idx[part] for part, idle in parts if not idle])
        assert padded <= 0.10, (seed, padded)


def test_a_random_checkpoint_is_saved_whole_or_not_at_all(tmp_path, monkeypatch):
    """save_random_model moves config.json, what a later --model-dir takes for a saved checkpoint (the GPU
    check's later sections reuse the 1.7B one), into the folder last: a run killed while saving (here, after its
    first file) leaves no config.json behind, and a whole save loads. Breaks if the checkpoint is saved straight
    into the folder (save_pretrained writes config.json first)."""
    import torch
    from transformers import AutoModelForCausalLM
    tp = load_script("benchmarks/train_passes.py")
    real, moved = os.replace, []

    def replace(src, dst):
        if moved:
            raise KeyboardInterrupt  # the kill
        moved.append(dst)
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        tp.save_random_model(str(tmp_path / "killed"), "tiny", torch.device("cpu"))
    assert moved and not (tmp_path / "killed" / "config.json").exists()
    monkeypatch.setattr(os, "replace", real)
    tp.save_random_model(str(tmp_path / "whole"), "tiny", torch.device("cpu"))
    assert "config.json" in os.listdir(tmp_path / "whole")
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "whole")).config.hidden_size == 64


def test_a_zero_peak_gives_no_ratio_and_the_tables_still_print(capsys):
    """At a tiny shape on CPU a pass can fit in memory the process already holds, so its peak above the inputs
    is 0 (CI measured it so for the naive head): the memory ratio is then n/a, and both scripts' tables print.
    Breaks on a bare division by the peak (a ZeroDivisionError ended logprobs.py before its ratios)."""
    from types import SimpleNamespace
    lp = load_script("benchmarks/logprobs.py")
    assert lp.ratio(1.0, 0.0, 3) == "n/a" and lp.ratio(1.0, 2.0, 2) == "0.50x"
    row = {"seconds": 0.5, "peak_gb": 0.0, "name": "cpu", "dtype": "float32", "chunk": "-", "compiled": False}
    res = {"naive": row, "chunked": {**row, "peak_gb": 0.01, "chunk": 128}, "trl": {**row, "seconds": 0.25}}
    lp.print_table(SimpleNamespace(batch=2, seq=16, vocab=300, hidden=16), res, {})
    tp = load_script("benchmarks/train_passes.py")
    phase = {"seconds": 1.0, "tokens_per_s": 10, "tflops": 0.0, "mfu": None, "peak_gib": 0.0, "padded_frac": 0.0,
             "layers": "eager", "eager_layer_calls": 4, "ran_eager_although_compiled": False}
    tp.print_table({"update": {**phase, "peak_gib": 0.5}, "full_logits": phase, "old_pass": phase},
                   SimpleNamespace(shape="tiny", samples=4, micro_tokens=64), "cpu", None, "equal")
    assert capsys.readouterr().out


# ---- the GPU check's driver ---------------------------------------------------------------------------

def _checked(tmp_path, monkeypatch, sections, budget=60, background=None):
    """gpu_check's driver on stand-in sections (python -c commands), in a tiny budget: its exit status, its
    JSON lines and its summary."""
    gc = load_script("benchmarks/gpu_check.py")
    monkeypatch.setattr(gc, "SECTIONS", sections)
    monkeypatch.setattr(gc, "BACKGROUND", background or {})
    monkeypatch.setattr(gc, "BUDGET", {"gpu": budget, "tiny": budget})
    monkeypatch.setattr(gc, "MIN_START", {"gpu": 1, "tiny": 1})
    monkeypatch.setattr(gc, "digest", lambda: "0" * 16)  # the tree's walk: seconds the budget need not hold
    monkeypatch.setenv("STAPO_COMMIT", "0123456789abcdef")
    status = gc.main(["--out", str(tmp_path)])
    [jsonl] = [f for f in os.listdir(tmp_path) if f.endswith(".jsonl")]
    lines = [json.loads(x) for x in open(tmp_path / jsonl)]
    return status, lines, lines[-1]


def _py(code):
    """A stand-in job: python -c code, as a SECTIONS template (its braces escaped)."""
    return "{py} -c " + shlex.quote(code).replace("{", "{{").replace("}", "}}")


def test_the_check_stops_after_a_failed_preflight(tmp_path, monkeypatch):
    """The preflight is first, and when it fails the check stops with exit status 3, nothing else run. Breaks if
    the check goes on to spend the lease after a preflight that failed (torch 2.11's TypeError at the first
    compiled build)."""
    sections = [dict(name="preflight", cap=(5, 5), stop=True, jobs={"preflight": _py("raise SystemExit(1)")}),
                dict(name="later", cap=(5, 5), jobs={"later": _py("print('ran')")})]
    status, lines, summary = _checked(tmp_path, monkeypatch, sections)
    assert status == 3 and summary["sections"] == {"preflight": ["failed"]} and summary["not_reached"] == ["later"]
    assert lines[0]["provenance"]["commit"] and lines[0]["tree_digest"] == "0" * 16


def test_the_check_refuses_to_run_without_a_commit(tmp_path, monkeypatch):
    """On the device the tree comes without .git: without STAPO_COMMIT (or with the documented call's placeholder
    left in) the check writes nothing and exits 2, so no lease is spent on a log that cannot name its code.
    Breaks if the check starts without a commit."""
    gc = load_script("benchmarks/gpu_check.py")
    monkeypatch.setattr(gc, "ROOT", str(tmp_path))  # a tree without .git
    monkeypatch.delenv("STAPO_COMMIT", raising=False)
    assert gc.main(["--out", str(tmp_path / "out")]) == 2 and not (tmp_path / "out").exists()
    monkeypatch.setenv("STAPO_COMMIT", "<sha>")  # the documented call's placeholder, left as it is
    assert gc.main(["--out", str(tmp_path / "out")]) == 2 and not (tmp_path / "out").exists()


def test_the_check_cuts_at_caps_passes_time_on_and_fails_on_a_failed_job(tmp_path, monkeypatch):
    """Each section within its cap (a job past it is cut), the time a section leaves unused goes to the next, a
    job with too little time left is not run, a failed job makes the exit status 1, the jobs' JSON lines come
    into the .jsonl with their section and job, and a row whose layers ran eager although compiled is a
    finding. Breaks if a cap does not stop its job, if a failed job leaves the exit status 0, or if a JSON line
    is lost."""
    row = json.dumps({"phase": "update", "ran_eager_although_compiled": True, "eager_layer_calls": 4})
    sections = [dict(name="preflight", cap=(5, 5), stop=True, jobs={"preflight": _py("print('{\"ok\": 1}')")}),
                dict(name="slow", cap=(2, 2), jobs={"slow": _py("import time; time.sleep(30)")}),
                dict(name="broken", cap=(5, 5), jobs={"broken": _py(f"print({row!r}); raise SystemExit(4)")}),
                dict(name="together", cap=(20, 20), together=True,
                     jobs={"a": _py("print('{\"a\": 1}')"), "b": _py("print('{\"b\": 2}')")}),
                dict(name="the_rest", cap=(60, 60), jobs={"rest": _py("import time; time.sleep(60)")}),
                dict(name="unfunded", cap=(60, 60), jobs={"late": _py("print('ran')")})]
    status, lines, summary = _checked(tmp_path, monkeypatch, sections, budget=8)
    assert status == 1 and summary["failed"] == ["broken"]
    assert summary["sections"] == {"preflight": ["ok"], "slow": ["cut"], "broken": ["failed"],
                                   "together": ["ok", "ok"], "the_rest": ["cut"], "unfunded": ["not_run"]}, summary
    took = {x["job"]: x["seconds"] for x in lines if "seconds" in x and "job" in x}
    assert took["slow"] < 6 and took["rest"] < 8  # stopped at its 2 s cap, and at the budget's end
    assert summary["seconds"] < 20
    rows = {(x["section"], x["job"]): x["row"] for x in lines if "row" in x}
    assert rows[("broken", "broken")]["eager_layer_calls"] == 4 and rows[("together", "b")] == {"b": 2}
    assert len(summary["findings"]) == 1 and "broken" in summary["findings"][0]


@pytest.mark.docs
def test_the_gpu_check_plan_fits_the_lease_and_its_call_is_the_docs():
    """The check as data, and docs/performance.md's call of it: the preflight first, capped at 20 s, stopping
    the check; every pytest job's selection picks at least one test of its files; the call (at most 2,000
    characters) passes STAPO_COMMIT, carries the wheels in .whl and gives the driver its budget and a margin
    inside its timeout_s, which with a 2-minute start stays within 12 minutes. Breaks if the budget or a cap
    grows past the lease, if the documented call drifts from the driver, or if a test rename leaves a device
    job selecting nothing."""
    gc = load_script("benchmarks/gpu_check.py")
    first = gc.SECTIONS[0]
    assert first["name"] == "preflight" and first["stop"] and first["cap"][0] <= 20
    doc = open(os.path.join(ROOT, "docs", "performance.md")).read()
    call = json.loads(re.search(r"```json\n(\{.*?\})\n```", doc, re.S).group(1))
    assert set(call) == {"command", "timeout_s", "carry"} and call["carry"] == [".whl"]
    assert len(call["command"]) <= 2000 and "STAPO_COMMIT=" in call["command"]
    assert "python3 benchmarks/gpu_check.py --out $OUT" in call["command"]
    assert gc.BUDGET["gpu"] + 30 <= call["timeout_s"] <= 600 and call["timeout_s"] + 120 <= 12 * 60
    table = re.findall(r"^\| (\d+) \| (\w+) \| (\d+) s \|", doc, re.M)  # the page's table of the sections
    assert [(name, int(cap)) for _, name, cap in table] == [(s["name"], s["cap"][0]) for s in gc.SECTIONS]
    assert f"The whole\ncheck has {gc.BUDGET['gpu']} s." in doc
    files = [open(os.path.join(ROOT, name)).read() for name in gc.test_files()]
    tests = [t for text in files for t in re.findall(r"def (test_\w+)", text)]
    for section in gc.SECTIONS:
        for job, template in section["jobs"].items():
            if "-m pytest" in template:
                selection = shlex.split(template)[-1]
                expr = re.sub(r"\b(?!and\b|or\b|not\b)(\w+)", r"('\1' in name)", selection)
                assert any(eval(expr, {"name": t}) for t in tests), (job, selection)  # noqa: S307 (our own text)


# ---- slow: the scripts end to end -----------------------------------------------------------------------

@pytest.mark.slow
def test_train_passes_writes_every_field_at_a_tiny_shape(tmp_path):
    """The benchmark end to end on CPU (the project's build_policy, token_stats and update, the full-logits
    update, and TRL 1.16's own update on equal lengths), two length distributions, three levers (on the first
    lengths), every update profiled, as its results file holds them: the provenance first; every phase's line
    with every field, its time the trainer's own (seconds_by_phase, from metrics.StepMetrics) and its layers'
    eager calls; a lever reaches the trainer's passes; the run finished. About 40 s here."""
    tp = load_script("benchmarks/train_passes.py")
    lengths = [4, 4, 4, 18, 18, 40, 41, 42]  # sequences of 10, 10, 10, 24, 24, 46, 47, 48
    (tmp_path / "lengths.txt").write_text("\n".join(map(str, lengths)))
    r = subprocess.run([sys.executable, os.path.join(BENCH, "train_passes.py"), "--shape", "tiny", "--samples", "8",
                        "--prompt", "6", "--response", "12", "--lengths", f"{tmp_path / 'lengths.txt'},equal",
                        "--phases", "old_pass,update,full_logits,trl_update", "--micro-tokens", "96", "--reps", "1",
                        "--levers", "micro_tokens_x4,no_checkpointing+micro_tokens_x2,selective_checkpointing",
                        "--profile", "update", "--results", str(tmp_path / "results")],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    header, lines, end = _results(tmp_path / "results")
    assert header["results"] == "train_passes" and end["finished"] is True
    assert "train_passes.py" in header["provenance"]["command"] and header["provenance"]["cores"] >= 1
    build = lines[0]
    assert build["phase"] == "build" and build["head_chunk_rows_auto"] == 128
    assert build["head_compiled"] is False and build["layers_compiled"] is False  # as stapo.py on CPU
    assert build["device"] == "cpu" and build["peak_tflops"] is None and build["params"] > 0
    phases = {(x["lengths"], x["phase"]): x for x in lines[1:] if "seconds" in x and not x["lever"]}
    levers = {(x["lever"], x["phase"]): x for x in lines[1:] if x.get("lever") and "seconds" in x}
    combos = ("micro_tokens_x4", "no_checkpointing+micro_tokens_x2", "selective_checkpointing")
    assert set(levers) == {(lever, p) for lever in combos for p in ("old_pass", "update")}  # no full_logits
    base = phases["file", "update"]  # the trainer's cut at 96 tokens: 4 (at 192 and at 384: 3)
    assert (levers["micro_tokens_x4", "update"]["micro_batches"], levers["no_checkpointing+micro_tokens_x2",
            "update"]["micro_batches"], base["micro_batches"]) == (3, 3, 4)
    assert levers["selective_checkpointing", "update"]["micro_batches"] == 4
    assert set(phases) == {(d, p) for d in ("equal", "file") for p in ("old_pass", "update", "full_logits")} | {
        ("equal", "trl_update")}  # TRL's micro-batches count samples: equal lengths only
    trl = phases["equal", "trl_update"]  # 96 // 18 = 5 samples a micro-batch, in their order: 5 and 3
    assert trl["micro_batches"] == 2 and trl["padded_frac"] == 0 and trl["tokens"] == 8 * 18
    for x in list(phases.values()) + list(levers.values()):
        for field in ("seconds", "seconds_by_phase", "times", "tokens_per_s", "tflops", "mfu", "peak_gib",
                      "padded_frac", "micro_batches", "tokens", "tokens_computed", "host_syncs", "warmup_s",
                      "layers", "eager_layer_calls", "ran_eager_although_compiled"):
            assert field in x, (field, x)
        assert x["seconds"] > 0 and x["mfu"] is None and 0 <= x["padded_frac"] < 1
        # TRL's peak is counted above what the script held; its tiny step may fit in memory already held
        assert x["peak_gib"] >= 0 if x["phase"] == "trl_update" else x["peak_gib"] > 0, x
        assert x["host_syncs"] is None  # CUDA's sync debug mode: not on CPU
        if x["phase"] == "trl_update":
            assert x["layers"] == "trl" and x["eager_layer_calls"] is None
            continue
        assert x["seconds"] == pytest.approx(sum(x["seconds_by_phase"].values()), abs=2e-4)  # the trainer's clock
        assert set(x["seconds_by_phase"]) == ({"old_policy"} if x["phase"] == "old_pass" else
                                              {"backward", "optimizer"})
        # eager layers: each of the 2 layers' forward calls, once per micro-batch of the one timed run
        assert x["layers"] == "eager" and x["eager_layer_calls"] == 2 * x["micro_batches"], x
        assert x["ran_eager_although_compiled"] is False
    assert phases["equal", "update"]["padded_frac"] == 0 < base["padded_frac"]
    padding = [x for x in lines if x["phase"] == "padding"]
    assert [(x["lengths"], x["grouping"]) for x in padding] == [
        ("file", "trainers_cut"), ("file", "fewest_micro_batches"),
        ("equal", "trainers_cut"), ("equal", "fewest_micro_batches")]
    profiles = [x for x in lines if x["phase"] == "profile"]  # one per update run: the base's two, 3 levers
    assert [(x["of"], x["lever"]) for x in profiles] == [("update", None)] * 2 + [("update", c) for c in combos]
    assert all(x["wall_s"] > 0 and x["kernels_s"] is None and x["device_busy"] is None for x in profiles)
    for x in profiles:  # the time by kind: here the operators' own CPU time, mostly the head's and layers' mm
        assert list(x["by_kind_s"]) == [k for k, _ in tp.KINDS] + ["other"] and x["by_kind_s"]["matmul"] > 0
        assert 0 < sum(x["by_kind_s"].values()) <= 2 * x["wall_s"], x


@pytest.mark.slow  # the policy built, and its passes run
def test_a_row_whose_compiled_layers_ran_eager_says_so(monkeypatch, capsys):
    """train_passes.py with compiled layers: where every layer call ran compiled (dynamo's eager backend: traced,
    no code generated) each row says compiled with 0 eager calls; where the compiler fails on every layer graph
    (they then run eager, counted by layers.py) each row says it ran eager although compiled, with every call
    counted. Breaks if a row's eager calls miss the failed graphs' (the fallback's calls: issue 58's uncounted
    fallback) or a row counts the warm-up's compile instead of its timed runs."""
    import torch
    from torch._dynamo import register_backend
    tp = load_script("benchmarks/train_passes.py")

    @register_backend
    def no_compiler_here(graph, example_inputs):
        raise RuntimeError("no compiler here")

    def rows(compiler):
        tp.main(["--shape", "tiny", "--samples", "8", "--prompt", "6", "--response", "12", "--micro-tokens", "96",
                 "--reps", "1", "--phases", "old_pass,update", "--compile-layers", "on", "--layers-compiler", compiler,
                 "--levers", "eager_layers", "--results", "none"])
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
        return {(x["lever"], x["phase"]): x for x in lines if "seconds" in x and "lever" in x}

    try:
        traced, failed = rows("eager"), rows("no_compiler_here")
    finally:
        torch._dynamo.reset()
    for got in (traced, failed):
        assert set(got) == {(lever, p) for lever in (None, "eager_layers") for p in ("old_pass", "update")}
        for phase in ("old_pass", "update"):
            lever = got["eager_layers", phase]  # eager on purpose: counted, not marked
            assert lever["layers"] == "eager" and lever["eager_layer_calls"] == 4
            assert lever["ran_eager_although_compiled"] is False
    for phase in ("old_pass", "update"):
        assert traced[None, phase]["layers"] == "compiled" and traced[None, phase]["eager_layer_calls"] == 0
        assert traced[None, phase]["ran_eager_although_compiled"] is False
        row = failed[None, phase]  # 2 layers x 2 micro-batches, the timed run's
        assert row["layers"] == "compiled" and row["eager_layer_calls"] == 4 and row["layer_compile_failures"] >= 1
        assert row["ran_eager_although_compiled"] is True


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is absent: pip install -r "
                    "requirements-dev.txt")
def test_trls_trainer_is_freed_after_its_phase():
    """TRL's trainer (its weights and optimizer: about 19 GiB at 1.7B) is gone once its trl_update phase has
    printed and been profiled (on the same trainer), so the rows after it do not count its memory. In a fresh
    interpreter, where the first import of TRL's classes happens in the run. Breaks if the trainer stays in the
    cache, if it is dropped before its profile (which then builds another), or if the classes are first imported
    where the trainer is built (TRL's lazy import keeps the importing frames, and that frame's locals, alive)."""
    code = """if 1:
        import gc, importlib.util, sys, weakref
        spec = importlib.util.spec_from_file_location("tp", sys.argv[1])
        tp = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tp)
        built, real = [], tp.trl_trainer
        tp.trl_trainer = lambda *a, real=real: (lambda t: built.append(weakref.ref(t.model)) or t)(real(*a))
        tp.main(["--shape", "tiny", "--samples", "8", "--prompt", "6", "--response", "12", "--phases",
                 "trl_update", "--reps", "1", "--profile", "trl_update", "--results", "none"])
        gc.collect()
        print("alive", sum(ref() is not None for ref in built), "of", len(built))
    """
    r = subprocess.run([sys.executable, "-c", code, os.path.join(BENCH, "train_passes.py")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "alive 0 of 3", r.stdout[-2000:]  # warm-up, timed, profiled


@pytest.mark.slow  # the policy built, and an update run
def test_a_failed_profile_or_trl_update_says_where_and_the_run_goes_on(monkeypatch, capsys):
    """--profile on a device whose profiler fails, and TRL's update failing (TRL missing or changed): each gets
    one line that says where (phase, lengths, lever) and why, and the phases after it still run and print.
    Breaks if either error ends the run (on the GPU check, the rows after it)."""
    tp = load_script("benchmarks/train_passes.py")

    def broken(what):
        def fail(*args, **kwargs):
            raise RuntimeError(f"no {what} here")
        return fail

    monkeypatch.setattr(tp, "profile", broken("profiler"))
    monkeypatch.setattr(tp, "trl_trainer", broken("TRL"))
    tp.main(["--shape", "tiny", "--samples", "8", "--prompt", "6", "--response", "12", "--phases",
             "update,trl_update,old_pass", "--reps", "1", "--profile", "update", "--results", "none"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert {"phase": "profile", "of": "update", "lengths": "equal", "lever": None, "error": "RuntimeError",
            "detail": "no profiler here"} in lines
    assert {"phase": "trl_update", "lengths": "equal", "lever": None, "error": "RuntimeError",
            "detail": "no TRL here"} in lines
    assert [x["phase"] for x in lines if "seconds" in x] == ["build", "update", "old_pass"]


@pytest.mark.slow  # the tests' tiny model, its policy and the HF engine
def test_compiled_layers_measures_the_unchanged_policys_ratio_from_the_trainers_passes(tiny_vllm, tmp_path):
    """benchmarks/compiled_layers.py, its eager fp32 row: every micro-batch of step 0's 4 mini-batches (32 at 40
    tokens) gives the old pass's log p again in the update's forward (the ratio exactly 1), the probe gap is
    inside fp32's tolerance, every layer call is counted eager, and the results file holds the row. Breaks if
    the update's log p is compared with the old pass's at other rows of the mini-batch (part against idx[part])
    or the micro-batches are not the update's."""
    d, _ = tiny_vllm
    r = subprocess.run([sys.executable, os.path.join(BENCH, "compiled_layers.py"), "--dtypes", "fp32", "--rows",
                        "eager", "--work", str(d), "--results", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    header, [row], end = _results(tmp_path)
    assert header["results"] == "compiled_layers" and end["finished"] is True
    assert (row["dtype"], row["layers"], row["micro_batches"]) == ("fp32", "eager", 32)
    assert row["max_abs_log_ratio"] == 0.0 and row["probe_gap_max"] <= 1e-3 and row["probe_gap_mean"] <= 1e-4
    assert row["eager_layer_calls"] > 0 and row["ran_eager_although_compiled"] is False


@pytest.mark.slow
def test_logprobs_reports_the_chunk_the_head_chose_and_a_failed_variant(tmp_path):
    """benchmarks/logprobs.py: each variant's line in its results file, the head's rows with the chunk the head
    chose (128 on CPU) and uncompiled; a variant whose process fails (here TRL's, its package shadowed by one
    that cannot be imported; on a GPU, an OOM or TRL's kernel there) gets a line saying why, and the others
    still print. Breaks if one failed variant ends the script before the others' lines."""
    (tmp_path / "shadow" / "trl").mkdir(parents=True)
    (tmp_path / "shadow" / "trl" / "__init__.py").write_text("raise ImportError('no trl here')\n")
    r = subprocess.run([sys.executable, os.path.join(BENCH, "logprobs.py"), "--batch", "2", "--seq", "64",
                        "--vocab", "3000", "--hidden", "32", "--variants", "naive,trl,chunked,eager",
                        "--results", str(tmp_path / "results")], capture_output=True, text=True, cwd=ROOT,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(tmp_path / "shadow")})
    assert r.returncode == 0, r.stderr[-3000:]
    header, lines, end = _results(tmp_path / "results")
    assert header["results"] == "logprobs" and end["finished"] is True
    rows = {x["variant"]: x for x in lines}
    assert list(rows) == ["naive", "trl", "chunked", "eager"]
    assert "ImportError: no trl here" in rows["trl"]["error"] and "seconds" not in rows["trl"]
    for name in ("chunked", "eager"):
        assert rows[name]["chunk"] == 128 and rows[name]["compiled"] is False and rows[name]["seconds"] > 0
    assert rows["naive"]["chunk"] == "-"


def test_logprobs_trl_row_computes_what_the_head_computes():
    """benchmarks/logprobs.py's trl row is a like-for-like rival: TRL 1.16's fused head, called as the script
    calls it, gives the project's head's log p, entropy and both gradients (fp32 on CPU, a vocabulary of
    three of TRL's 32,768-entry tiles). A temperature, tile size or output passed wrong fails it."""
    pytest.importorskip("trl.kernels.chunked_logprob")
    import torch
    from head import token_logprobs_and_entropy
    lp = load_script("benchmarks/logprobs.py")
    torch.manual_seed(0)
    vocab = 2 * lp.TRL_VOCAB_CHUNK + 1000
    hidden, weight = torch.randn(96, 32), torch.randn(vocab, 32) * 32 ** -0.5
    tokens, coef = torch.randint(vocab, (96,)), torch.randn(96)
    got = []
    for fn in (lp.trl_head, token_logprobs_and_entropy):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, entropy = fn(h, w, tokens, 0.7)
        (logp * coef).sum().backward()
        got.append((logp.detach(), entropy.detach(), h.grad, w.grad))
    for name, a, b in zip(("logp", "entropy", "hidden grad", "weight grad"), *got):
        assert (a - b).norm() <= 1e-5 * b.norm(), name
