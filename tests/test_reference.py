"""The reference runs (tests/reference.py) give the metrics of BASELINE's trainer, key by key for every key both
have: a change meant to alter nothing (a refactor, a move between modules) must leave every sampled token,
reward, S2T count, loss statistic, gradient norm and analysis figure as it was. Timings and memory peaks vary
by nature and are left out. BASELINE's numbers come from its recording for this machine's warm start, or, on
a machine with none, from BASELINE's own trainer run beside this tree's: the guard never skips. A change that
alters what a key measures moves BASELINE to itself in the same commit, and says why."""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

import reference

slow = pytest.mark.slow


def assert_equal_runs(name, out, steps=None):
    """The run in out/<name> equals BASELINE's, over its first `steps` steps (all by default)."""
    try:
        golden = reference.baseline_rows(name, out, steps)
    except reference.NoBaseline as e:
        golden = str(e)
    if isinstance(golden, str):  # a shallow clone: one line, how to fetch the history
        pytest.fail(golden, pytrace=False)
    now = [reference.comparable(json.loads(line)) for line in open(os.path.join(out, name, "metrics.jsonl"))]
    assert len(now) == len(golden), name
    for old, new in zip(golden, now):
        shared = old.keys() & new.keys()
        assert len(shared) >= 45 and {"taxonomy/split", "grad_share/silenced"} <= shared, \
            (name, old.keys() ^ new.keys())
        for k in sorted(shared):
            a, b = old[k], new[k]
            if isinstance(a, float) and isinstance(b, float):  # sums over ranks: their order may differ
                assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), (name, old["step"], k, a, b)
            else:
                assert a == b, (name, old["step"], k, a, b)


def test_a_shallow_clone_says_in_one_line_how_to_fetch_the_baseline(tmp_path, monkeypatch):
    """In a clone without BASELINE's commit (git clone --depth 1 of this one), the guard stops with one line
    that names the commit and the command that fetches it, and leaves no empty baseline folder behind (which
    a second call would take for BASELINE's files)."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{reference.ROOT}", str(clone)], check=True)
    monkeypatch.setattr(reference, "ROOT", str(clone))
    for _ in range(2):
        with pytest.raises(reference.NoBaseline) as e:
            reference.baseline_tree(str(tmp_path))
        assert "\n" not in str(e.value) and reference.BASELINE in str(e.value), str(e.value)
        assert "git fetch --unshallow" in str(e.value)
    assert os.listdir(tmp_path) == ["clone"]


# The first steps of each recorded run (python tests/reference.py OUT reruns them whole): one warm start for
# the three toy runs, which share their model.
PREFIX = {"toy_1rank": 20, "toy_2ranks": 10, "toy_one_micro_batch": 10}


@slow
def test_the_toy_reference_runs_are_unchanged(tmp_path):
    runs = [f"{name}:{steps}" for name, steps in PREFIX.items()]
    subprocess.run([sys.executable, reference.__file__, str(tmp_path), *runs], check=True, timeout=900)
    for name, steps in PREFIX.items():
        assert_equal_runs(name, tmp_path, steps)


@slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM's CPU build is absent")
def test_the_vllm_reference_run_is_unchanged(tmp_path):
    subprocess.run([sys.executable, reference.__file__, str(tmp_path), "vllm_2ranks"], check=True, timeout=900)
    assert_equal_runs("vllm_2ranks", tmp_path)
