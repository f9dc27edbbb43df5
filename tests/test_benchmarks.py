"""benchmarks/train_passes.py and benchmarks/logprobs.py at tiny shapes on CPU: every field printed, the
padding arithmetic and the project's padding on a long tail. No test here asserts a time.

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
    """--padding-only computes two cuts without a process group (policy.cut_by_length): the trainer's, checked
    against policy.micro_batches itself, and the fewest micro-batches that fit, checked against a count by
    hand; on a long tail (the number the issue asks about) the trainer's cut makes more micro-batches, with
    less padding."""
    import policy
    tp = _load()
    monkeypatch.setattr(policy, "all_reduce_numbers", lambda *xs, op=None: list(xs))  # a world of one
    lengths = tp.response_lengths("lognormal", 64, 1024, 1.0, 3)
    rows = tp.make_rows(64, 256, lengths, 100, 1)
    idx = sorted(range(64), key=lambda i: len(rows[i][0]) + len(rows[i][1]))
    args = type("A", (), {"micro_tokens": 16384})
    tp.print_padding(rows, idx, args, "lognormal")
    printed = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["grouping"] for x in printed] == ["trainers_cut", "fewest_micro_batches"]
    groups = [idx[part] for part, idle in policy.micro_batches(rows, idx, 16384) if not idle]
    want = tp.padding(rows, groups)
    assert (printed[0]["padded_frac"], printed[0]["tokens_computed"], printed[0]["micro_batches"]) == (
        round(want[0], 4), want[1], len(groups))
    n, fewest, tokens = [len(rows[i][0]) + len(rows[i][1]) for i in idx], 0, 0
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
    decoder computes are padding in the micro-batches the trainer cuts, on any device, for ten seeds. The
    greedy cut CPU runs made until the cuts were one (the fewest that fit, each as long as fits) pads 10.3% at
    seed 0."""
    import policy
    tp = _load()
    monkeypatch.setattr(policy, "all_reduce_numbers", lambda *xs, op=None: list(xs))  # a world of one
    for seed in range(10):
        rows = tp.make_rows(64, 256, tp.response_lengths("lognormal", 64, 1024, 1.0, seed), 100, 1)
        idx = sorted(range(64), key=lambda i: len(rows[i][0]) + len(rows[i][1]))
        parts = policy.micro_batches(rows, idx, 16384)
        padded, _ = tp.padding(rows, [idx[part] for part, idle in parts if not idle])
        assert padded <= 0.10, (seed, padded)


def test_a_random_checkpoint_is_saved_whole_or_not_at_all(tmp_path, monkeypatch):
    """save_random_model moves config.json, what a later --model-dir takes for a saved checkpoint (the GPU
    check keeps the 1.7B one for its second part), into the folder last: a run killed while saving (here,
    after its first file) leaves no config.json behind, and a whole save loads. Breaks if the checkpoint is
    saved straight into the folder (save_pretrained writes config.json first)."""
    import torch
    from transformers import AutoModelForCausalLM
    tp = _load()
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


@pytest.mark.slow
def test_train_passes_prints_every_field_at_a_tiny_shape(tmp_path):
    """The benchmark end to end on CPU (the project's build_policy, token_stats and update, the full-logits
    update, and TRL 1.16's own update on equal lengths), two length distributions, four levers (on the first
    lengths), every update profiled: every phase's line has every field, the table and the ratios are
    printed; a lever reaches the trainer's passes. About 40 s here."""
    tp = _load()
    lengths = [4, 4, 4, 18, 18, 40, 41, 42]  # sequences of 10, 10, 10, 24, 24, 46, 47, 48
    (tmp_path / "lengths.txt").write_text("\n".join(map(str, lengths)))
    script = os.path.join(ROOT, "benchmarks", "train_passes.py")
    r = subprocess.run([sys.executable, script, "--shape", "tiny", "--samples", "8", "--prompt", "6",
                        "--response", "12", "--lengths", f"{tmp_path / 'lengths.txt'},equal",
                        "--phases", "old_pass,update,full_logits,trl_update",
                        "--micro-tokens", "96", "--reps", "1", "--levers",
                        "micro_tokens_x4,no_checkpointing+micro_tokens_x2,selective_checkpointing,"
                        "fewest_micro_batches",
                        "--profile", "update"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    build = lines[0]
    assert build["phase"] == "build" and build["head_chunk_rows_auto"] == 128
    assert build["head_compiled"] is False and build["layers_compiled"] is False  # as stapo.py on CPU
    assert build["device"] == "cpu" and build["peak_tflops"] is None and build["params"] > 0
    phases = {(x["lengths"], x["phase"]): x for x in lines[1:] if "seconds" in x and not x["lever"]}
    levers = {(x["lever"], x["phase"]): x for x in lines[1:] if x.get("lever") and "seconds" in x}
    combos = ("micro_tokens_x4", "no_checkpointing+micro_tokens_x2", "selective_checkpointing",
              "fewest_micro_batches")
    assert set(levers) == {(lever, p) for lever in combos for p in ("old_pass", "update")}  # no full_logits
    base = phases["file", "update"]  # the trainer's cut at 96 tokens: 4 (at 192 and at 384: 3)
    assert (levers["micro_tokens_x4", "update"]["micro_batches"], levers["no_checkpointing+micro_tokens_x2",
            "update"]["micro_batches"], base["micro_batches"]) == (3, 3, 4)
    assert levers["selective_checkpointing", "update"]["micro_batches"] == 4
    fewest = levers["fewest_micro_batches", "update"]  # the fewest that fit 96 tokens: 3, with more padding
    assert fewest["micro_batches"] == 3 and fewest["padded_frac"] > base["padded_frac"]
    assert set(phases) == {(d, p) for d in ("equal", "file") for p in ("old_pass", "update", "full_logits")} | {
        ("equal", "trl_update")}  # TRL's micro-batches count samples: equal lengths only
    trl = phases["equal", "trl_update"]  # 96 // 18 = 5 samples a micro-batch, in their order: 5 and 3
    assert trl["micro_batches"] == 2 and trl["padded_frac"] == 0 and trl["tokens"] == 8 * 18
    for x in phases.values():
        for field in ("seconds", "times", "tokens_per_s", "tflops", "mfu", "peak_gib", "padded_frac",
                      "micro_batches", "tokens", "tokens_computed", "host_syncs", "warmup_s"):
            assert field in x, (field, x)
        assert x["seconds"] > 0 and x["mfu"] is None and 0 <= x["padded_frac"] < 1
        # TRL's peak is counted above what the script held; its tiny step may fit in memory already held
        assert x["peak_gib"] >= 0 if x["phase"] == "trl_update" else x["peak_gib"] > 0, x
        assert x["host_syncs"] is None  # CUDA's sync debug mode: not on CPU
    assert phases["equal", "update"]["padded_frac"] == 0 < base["padded_frac"]
    padding = [x for x in lines if x["phase"] == "padding"]
    assert [(x["lengths"], x["grouping"]) for x in padding] == [
        ("file", "trainers_cut"), ("file", "fewest_micro_batches"),
        ("equal", "trainers_cut"), ("equal", "fewest_micro_batches")]
    assert r.stdout.count("| update |") == 6 and r.stdout.count("update / full_logits: time") == 2
    assert r.stdout.count("| trl_update |") == 1
    profiles = [x for x in lines if x["phase"] == "profile"]  # one per update run: the base's two, 4 levers
    assert [(x["of"], x["lever"]) for x in profiles] == [("update", None)] * 2 + [("update", c) for c in combos]
    assert all(x["wall_s"] > 0 and x["kernels_s"] is None and x["device_busy"] is None for x in profiles)
    for x in profiles:  # the time by kind: here the operators' own CPU time, mostly the head's and layers' mm
        assert list(x["by_kind_s"]) == [k for k, _ in tp.KINDS] + ["other"] and x["by_kind_s"]["matmul"] > 0
        assert 0 < sum(x["by_kind_s"].values()) <= 2 * x["wall_s"], x
    assert r.stdout.count("Self CPU time total") == 6 and "aten::mm" in r.stdout  # the profiler's tables
    assert "MFU against no TFLOP/s (model FLOPs: 2N per token" in r.stdout


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is absent: pip install -r "
                    "requirements-dev.txt")
def test_trls_trainer_is_freed_after_its_phase():
    """TRL's trainer (its weights and optimizer: about 19 GiB at 1.7B) is gone once its trl_update phase has
    printed and been profiled (on the same trainer), so the rows after it (the levers', in the GPU check's
    part 2) do not count its memory. In a fresh interpreter, where the first import of TRL's classes happens
    in the run. Breaks if the trainer stays in the cache, if it is dropped before its profile (which then
    builds another), or if the classes are first imported where the trainer is built (TRL's lazy import keeps
    the importing frames, and that frame's locals, alive)."""
    code = """if 1:
        import gc, importlib.util, sys, weakref
        spec = importlib.util.spec_from_file_location("tp", sys.argv[1])
        tp = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tp)
        built, real = [], tp.trl_trainer
        tp.trl_trainer = lambda *a, real=real: (lambda t: built.append(weakref.ref(t.model)) or t)(real(*a))
        tp.main(["--shape", "tiny", "--samples", "8", "--prompt", "6", "--response", "12", "--phases",
                 "trl_update", "--reps", "1", "--profile", "trl_update"])
        gc.collect()
        print("alive", sum(ref() is not None for ref in built), "of", len(built))
    """
    r = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "benchmarks", "train_passes.py")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "alive 0 of 3", r.stdout[-2000:]  # warm-up, timed, profiled


@pytest.mark.slow  # the policy built, and an update run
def test_a_failed_profile_or_trl_update_says_where_and_the_run_goes_on(monkeypatch, capsys):
    """--profile on a device whose profiler fails (it has not run on a GPU yet), and TRL's update failing (TRL
    missing or changed): each gets one line that says where (phase, lengths, lever) and why, and the phases
    after it still run and print. Breaks if either error ends the run (on the GPU check, the rows after it:
    TRL's update, the other cut)."""
    tp = _load()

    def broken(what):
        def fail(*args, **kwargs):
            raise RuntimeError(f"no {what} here")
        return fail

    monkeypatch.setattr(tp, "profile", broken("profiler"))
    monkeypatch.setattr(tp, "trl_trainer", broken("TRL"))
    tp.main(["--shape", "tiny", "--samples", "8", "--prompt", "6", "--response", "12", "--phases",
             "update,trl_update,old_pass", "--reps", "1", "--profile", "update"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert {"phase": "profile", "of": "update", "lengths": "equal", "lever": None, "error": "RuntimeError",
            "detail": "no profiler here"} in lines
    assert {"phase": "trl_update", "lengths": "equal", "lever": None, "error": "RuntimeError",
            "detail": "no TRL here"} in lines
    assert [x["phase"] for x in lines if "seconds" in x] == ["build", "update", "old_pass"]


def test_logprobs_trl_row_computes_what_the_head_computes():
    """benchmarks/logprobs.py's trl row is a like-for-like rival: TRL 1.16's fused head, called as the script
    calls it, gives the project's head's log p, entropy and both gradients (fp32 on CPU, a vocabulary of
    three of TRL's 32,768-entry tiles). A temperature, tile size or output passed wrong fails it."""
    pytest.importorskip("trl.kernels.chunked_logprob")
    import torch
    from head import token_logprobs_and_entropy
    spec = importlib.util.spec_from_file_location("logprobs", os.path.join(ROOT, "benchmarks", "logprobs.py"))
    lp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lp)
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


@pytest.mark.slow
def test_logprobs_reports_the_chunk_the_head_chose():
    script = os.path.join(ROOT, "benchmarks", "logprobs.py")
    r = subprocess.run([sys.executable, script, "--batch", "2", "--seq", "64", "--vocab", "3000", "--hidden",
                        "32", "--variants", "naive,chunked,eager,trl"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| chunked | 128 | False |" in r.stdout and "| eager | 128 | False |" in r.stdout, r.stdout
    assert "chunked/naive: time" in r.stdout and "(chunk 128)" in r.stdout
    assert "| trl | - | - |" in r.stdout and "chunked/trl: time" in r.stdout


def test_a_peak_of_zero_prints_na_and_the_table_still_prints(capsys):
    """At a tiny shape on CPU a pass can fit in memory the process already holds, so its peak above the inputs
    is 0 (CI measured it so for the naive head). The memory ratios then say n/a, and the tables print. Breaks
    on a bare division by the peak (a ZeroDivisionError ended logprobs.py before its ratios)."""
    from types import SimpleNamespace
    spec = importlib.util.spec_from_file_location("logprobs", os.path.join(ROOT, "benchmarks", "logprobs.py"))
    lp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lp)
    row = {"seconds": 0.5, "peak_gb": 0.0, "name": "cpu", "dtype": "float32", "chunk": "-", "compiled": False}
    res = {"naive": row, "chunked": {**row, "peak_gb": 0.01, "chunk": 128}, "trl": {**row, "seconds": 0.25}}
    lp.print_table(SimpleNamespace(batch=2, seq=16, vocab=300, hidden=16), res, {})
    out = capsys.readouterr().out
    assert "chunked/naive: time 1.00x, memory n/a (chunk 128)" in out, out
    assert "trl/naive: time 0.50x, memory n/a" in out and "chunked/trl: time 2.00x, memory n/a" in out, out
    tp = _load()
    phase = {"seconds": 1.0, "tokens_per_s": 10, "tflops": 0.0, "mfu": None, "peak_gib": 0.0, "padded_frac": 0.0}
    tp.print_table({"update": {**phase, "peak_gib": 0.5}, "full_logits": phase},
                   SimpleNamespace(shape="tiny", samples=4, micro_tokens=64), "cpu", None, "equal")
    assert "update / full_logits: time 1.00x, peak memory n/a (one run)" in capsys.readouterr().out


@pytest.mark.slow
def test_logprobs_prints_the_other_rows_when_a_variant_fails(tmp_path):
    """A variant whose process fails (here TRL's, its package shadowed by one that cannot be imported; on a GPU,
    an OOM or TRL's kernel on that device) gets a row that says why, and the others still print with their
    ratios: the GPU check's head section asks for the trl row beside the head's own. Breaks if one failed
    variant ends the script before its table."""
    (tmp_path / "trl").mkdir()
    (tmp_path / "trl" / "__init__.py").write_text("raise ImportError('no trl here')\n")
    script = os.path.join(ROOT, "benchmarks", "logprobs.py")
    r = subprocess.run([sys.executable, script, "--batch", "2", "--seq", "16", "--vocab", "300", "--hidden",
                        "16", "--variants", "naive,trl,chunked"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| trl | failed: ImportError: no trl here |" in r.stdout, r.stdout
    assert "| naive | - | - |" in r.stdout and "chunked/naive: time" in r.stdout and "/trl" not in r.stdout
