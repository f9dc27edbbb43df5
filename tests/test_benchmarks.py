"""benchmarks/train_passes.py and benchmarks/logprobs.py at tiny shapes on CPU: every field printed, the
padding arithmetic and the prototype grouping. No test here asserts a time.

The GPU check's CPU rehearsal (benchmarks/gpu_check.sh with GPU_CHECK_TINY=1) takes minutes, so it is not a
test: docs/performance.md gives its command."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    path = os.path.join(ROOT, "benchmarks", "train_passes.py")
    spec = importlib.util.spec_from_file_location("train_passes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(lengths, prompt=4):
    return [([1] * prompt, [2] * n) for n in lengths]


def test_the_long_tail_is_seeded_and_clipped_and_a_file_is_read(tmp_path):
    tp = _load()
    a, b = (tp.response_lengths("lognormal", 500, 1024, 1.0, 0) for _ in range(2))
    assert a == b != tp.response_lengths("lognormal", 500, 1024, 1.0, 1)
    assert min(a) == 200 and max(a) == 8192 and 700 < sorted(a)[250] < 1500  # clipped both ends; median 1,024
    assert tp.response_lengths("equal", 3, 77, 1.0, 0) == [77, 77, 77]
    (tmp_path / "lengths.jsonl").write_text('{"response_len": 5}\n{"tokens": [1, 2, 3]}\n\n7\n')
    assert tp.response_lengths(str(tmp_path / "lengths.jsonl"), 5, 0, 1.0, 0) == [5, 3, 7, 5, 3]


def test_padding_counts_each_micro_batch_at_its_longest():
    tp = _load()
    rows = _rows([6, 16, 16], prompt=4)  # sequences of 10, 20, 20
    assert tp.padding(rows, [[0, 1, 2]]) == (1 - 50 / 60, 60)
    assert tp.padding(rows, [[0], [1, 2], None]) == (0.0, 50)


def test_the_padding_only_rule_is_policy_micro_batches(monkeypatch, capsys):
    """--padding-only computes the project's grouping without a process group (policy.runs): the groups of
    policy.micro_batches (the number the issue asks about), checked against that function on a long tail."""
    import policy
    tp = _load()
    monkeypatch.setattr(policy, "all_reduce_numbers", lambda *xs, op=None: list(xs))  # a world of one
    lengths = tp.response_lengths("lognormal", 64, 1024, 1.0, 3)
    rows = tp.make_rows(64, 256, lengths, 100, 1)
    idx = sorted(range(64), key=lambda i: len(rows[i][0]) + len(rows[i][1]))
    args = type("A", (), {"micro_tokens": 16384})
    tp.print_padding(rows, idx, args, "lognormal", project=None)
    printed = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    want = tp.padding(rows, [idx[part] for part in policy.micro_batches(rows, idx, 16384)])
    assert (printed[0]["padded_frac"], printed[0]["tokens_computed"]) == (round(want[0], 4), want[1])
    assert [x["grouping"] for x in printed] == ["policy.micro_batches", "balanced_micro_batches"]


def test_the_balanced_grouping_keeps_the_budget_and_pads_less_than_the_projects():
    """Every sample once, shortest first, no micro-batch over the budget (but a lone sample longer than it);
    on the default long tail (64 samples, prompt 256, responses log-normal median 1,024, seed 0, 16,384
    tokens) at most 10% padding (the project's rule: 10.3%); equal lengths in as few micro-batches as fit."""
    tp = _load()
    rows = tp.make_rows(64, 256, tp.response_lengths("lognormal", 64, 1024, 1.0, 0), 100, 1)
    idx = sorted(range(64), key=lambda i: len(rows[i][0]) + len(rows[i][1]))
    groups = tp.balanced_micro_batches(rows, idx, 16384)
    assert sum(groups, []) == idx
    size = lambda i: len(rows[i][0]) + len(rows[i][1])  # noqa: E731
    assert all(len(g) * max(map(size, g)) <= 16384 or len(g) == 1 for g in groups)
    balanced, _ = tp.padding(rows, groups)
    assert balanced <= 0.10
    long = _rows([20000, 10, 10])
    assert sum(tp.balanced_micro_batches(long, [1, 2, 0], 1000), []) == [1, 2, 0]
    equal = _rows([100] * 40)
    assert len(tp.balanced_micro_batches(equal, list(range(40)), 1040)) == 4  # 10 of 104 tokens each


@pytest.mark.slow
def test_train_passes_prints_every_field_at_a_tiny_shape(tmp_path):
    """The benchmark end to end on CPU (the project's build_policy, token_stats and update, and the
    full-logits update), two length distributions, both groupings, two levers (on the first lengths, the
    project's grouping), every update profiled: every phase's line has every field, the table and the ratios
    are printed. About 30 s here."""
    tp = _load()
    lengths = [4, 4, 4, 18, 18, 40, 41, 42]  # sequences of 10, 10, 10, 24, 24, 46, 47, 48
    (tmp_path / "lengths.txt").write_text("\n".join(map(str, lengths)))
    rows = _rows(lengths, prompt=6)
    idx = sorted(range(8), key=lambda i: len(rows[i][1]))
    assert tp.balanced_micro_batches(rows, idx, 96) != [[0, 1, 2, 3], [4, 5], [6, 7]]  # the project's
    script = os.path.join(ROOT, "benchmarks", "train_passes.py")
    r = subprocess.run([sys.executable, script, "--shape", "tiny", "--samples", "8", "--prompt", "6",
                        "--response", "12", "--lengths", f"equal,{tmp_path / 'lengths.txt'}", "--grouping",
                        "project,balanced", "--micro-tokens", "96", "--reps", "1", "--levers",
                        "micro_tokens_x4,no_checkpointing", "--profile", "update"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    build = lines[0]
    assert build["phase"] == "build" and build["head_chunk_rows_auto"] == 128
    assert build["head_compiled"] is False and build["layers_compiled"] is False  # as stapo.py on CPU
    assert build["device"] == "cpu" and build["peak_tflops"] is None and build["params"] > 0
    phases = {(x["lengths"], x["grouping"], x["phase"]): x for x in lines[1:] if "seconds" in x
              and not x["lever"]}
    levers = {(x["lever"], x["phase"]): x for x in lines[1:] if x.get("lever") and "seconds" in x}
    assert set(levers) == {(lever, p) for lever in ("micro_tokens_x4", "no_checkpointing")
                           for p in ("old_pass", "update")}  # no full_logits: the levers are the policy's
    assert levers["micro_tokens_x4", "update"]["micro_batches"] < phases["equal", "project", "update"][
        "micro_batches"] == levers["no_checkpointing", "update"]["micro_batches"]
    want = {("equal", "project", p) for p in ("old_pass", "update", "full_logits")}
    want |= {("file", "project", p) for p in ("old_pass", "update", "full_logits")}
    want |= {("file", "balanced", p) for p in ("old_pass", "update")}  # equal lengths: no balanced run
    assert set(phases) == want, sorted(phases)
    for x in phases.values():
        for field in ("seconds", "times", "tokens_per_s", "tflops", "mfu", "peak_gib", "padded_frac",
                      "micro_batches", "tokens", "tokens_computed", "host_syncs", "warmup_s"):
            assert field in x, (field, x)
        assert x["seconds"] > 0 and x["peak_gib"] > 0 and x["mfu"] is None and 0 <= x["padded_frac"] < 1
        assert x["host_syncs"] is None  # CUDA's sync debug mode: not on CPU
    assert phases[("equal", "project", "update")]["padded_frac"] == 0
    assert phases[("file", "project", "update")]["padded_frac"] > phases[("file", "balanced", "update")][
        "padded_frac"]
    padding = [x for x in lines if x["phase"] == "padding"]
    assert [(x["lengths"], x["grouping"]) for x in padding] == [
        ("equal", "policy.micro_batches"), ("equal", "balanced_micro_batches"),
        ("file", "policy.micro_batches"), ("file", "balanced_micro_batches")]
    assert r.stdout.count("| update |") == 5 and r.stdout.count("update / full_logits: time") == 2
    profiles = [x for x in lines if x["phase"] == "profile"]  # one per update run: the base's three, two levers
    assert [(x["of"], x["lever"]) for x in profiles] == [("update", None)] * 3 + [
        ("update", "micro_tokens_x4"), ("update", "no_checkpointing")]
    assert all(x["wall_s"] > 0 and x["kernels_s"] is None and x["device_busy"] is None for x in profiles)
    assert r.stdout.count("Self CPU time total") == 5 and "aten::mm" in r.stdout  # the profiler's tables
    assert "MFU against no TFLOP/s (model FLOPs: 2N per token" in r.stdout


@pytest.mark.slow
def test_logprobs_reports_the_chunk_the_head_chose():
    script = os.path.join(ROOT, "benchmarks", "logprobs.py")
    r = subprocess.run([sys.executable, script, "--batch", "2", "--seq", "64", "--vocab", "3000", "--hidden",
                        "32", "--variants", "naive,chunked,eager"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| chunked | 128 | False |" in r.stdout and "| eager | 128 | False |" in r.stdout, r.stdout
    assert "chunked/naive: time" in r.stdout and "(chunk 128)" in r.stdout
