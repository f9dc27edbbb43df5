"""The CPU toy learns: a shortened run of examples/toy.py (120 of its 600 steps)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import toy  # noqa: E402


def test_toy_learns_in_a_shortened_run(tmp_path, capsys):
    before, after = toy.main(["--out", str(tmp_path), "--steps", "120"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"toy: accuracy {before:.2f} -> {after:.2f}"
    assert 0 <= before <= 0.4          # the warm start knows the format, and few of the sums
    assert after >= before + 0.2       # see the README for the measured figures; the full 600 steps reach >= 0.8
    assert os.path.exists(tmp_path / "rl" / "model" / "config.json")


def test_all_four_objectives_from_one_warm_start(tmp_path, capsys):
    """--method all: a row per objective in the table, a run folder each, and their curves in one PNG."""
    import pytest
    pytest.importorskip("matplotlib")
    table = toy.main(["--out", str(tmp_path), "--method", "all", "--steps", "2", "--sft-steps", "5",
                      "--prompts", "8", "--minibatches", "1"])
    assert [row.split(" | ")[0] for row in table[2:]] == ["| stapo", "| justrl", "| grpo", "| entropy20"]
    assert "\n".join(table) in capsys.readouterr().out
    for method in toy.METHODS:
        assert len(open(tmp_path / method / "metrics.jsonl").readlines()) == 2
    assert (tmp_path / "curves.png").stat().st_size > 10_000
