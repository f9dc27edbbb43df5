"""curves.py: the panels from run folders, the silenced-token table, and a clear error without matplotlib."""
import json
import sys

import pytest

import curves


def run_folder(path, steps, silenced_tokens, with_eval=False):
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            row = {"step": s, "accuracy": s / steps, "reward_mean": 2 * s / steps - 1, "entropy_mean": 1.0,
                   "response_len_mean": 5.0, "silenced_frac": 0.01, "tau_h": None if s == 1 else 0.3,
                   "clip_low": 0.0, "clip_high": 0.02, "grad_norm": 0.5}
            row.update({"eval/average": 10.0 * s} if with_eval else {})
            f.write(json.dumps(row) + "\n")
    with open(path / "silenced.jsonl", "w") as f:
        for token in silenced_tokens:
            f.write(json.dumps({"step": 1, "token": token, "p": 0.01, "H": 0.2, "left": "", "right": ""}) + "\n")
    return path


def test_curves_draw_every_panel_that_has_data(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a = run_folder(tmp_path / "a", 5, ["x"])
    b = run_folder(tmp_path / "b", 3, ["y"], with_eval=True)
    curves.main([str(a), f"GRPO={b}", "--out", str(tmp_path / "c.png"), "--smooth", "2"])
    assert "8 panels, 2 runs" in capsys.readouterr().out  # held-out accuracy only because b has eval lines
    assert (tmp_path / "c.png").stat().st_size > 10_000
    curves.main([str(a), "--out", str(tmp_path / "d.png")])
    assert "7 panels, 1 runs" in capsys.readouterr().out


def test_series_skip_missing_values_and_smoothing_by_hand():
    rows = [{"step": 1, "tau_h": None}, {"step": 2, "tau_h": 0.2}, {"step": 3, "tau_h": 0.4}]
    assert curves.series(rows, "tau_h") == ([2, 3], [0.2, 0.4])
    assert curves.smooth([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]


def test_silenced_view_counts_tokens_per_run(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a = run_folder(tmp_path / "stapo", 2, ["the", "the", "\n", "the", "x"])
    b = run_folder(tmp_path / "justrl", 2, ["x", "x"])
    curves.main([str(a), str(b), "--silenced", "--top", "2", "--out", str(tmp_path / "s.png")])
    out = capsys.readouterr().out
    assert "| rank | stapo (of 5) | justrl (of 2) |" in out
    assert "| 1 | `the` 3 | `x` 2 |" in out and "| 2 | `\\n` 1 |  |" in out
    assert (tmp_path / "s.png").stat().st_size > 5_000


def test_a_missing_matplotlib_or_folder_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="metrics.jsonl: no such file"):
        curves.main([str(tmp_path / "nowhere")])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        curves.pyplot()


def test_taxonomy_averages_the_groups_over_steps_and_draws_them(tmp_path, capsys):
    """Token shares average over steps; gradient norm and entropy change average weighted by each step's share.
    By hand for one group: shares .1 and .3, norms 2 and 4 -> (.1 * 2 + .3 * 4) / .4 = 3.5. A step with no
    tau_h in any mini-batch (taxonomy/split 0) has no groups and is left out, not counted as empty groups."""
    a = run_folder(tmp_path / "stapo", 3, ["x"])
    rows = [json.loads(x) for x in open(a / "metrics.jsonl")]
    for r, share, norm, dh in zip(rows, (0.1, 0.3, 0.0), (2.0, 4.0, None), (-1.0, 1.0, None)):
        for g in curves.GROUPS:
            r.update({f"taxonomy/{g}/tokens": 0.0, f"taxonomy/{g}/grad_norm": None, f"taxonomy/{g}/dH": None})
        r.update({"taxonomy/split": 1.0 if norm else 0.0, "taxonomy/posA_lowP_lowH/tokens": share,
                  "taxonomy/posA_lowP_lowH/grad_norm": norm, "taxonomy/posA_lowP_lowH/dH": dh,
                  "taxonomy/posA_highP_highH/tokens": 1 - share if norm else 0.0,
                  "taxonomy/posA_highP_highH/grad_norm": 1.0, "taxonomy/posA_highP_highH/dH": 0.5})
    (a / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = curves.taxonomy(rows)
    assert t["posA_lowP_lowH"] == {"tokens": pytest.approx(0.2), "grad_norm": pytest.approx(3.5),
                                   "dH": pytest.approx((0.1 * -1 + 0.3 * 1) / 0.4)}
    assert t["negA_highP_lowH"] == {"tokens": 0.0, "grad_norm": None, "dH": None}
    pytest.importorskip("matplotlib")
    curves.main([str(a), "--taxonomy", "--out", str(tmp_path / "t.png")])
    out = capsys.readouterr().out
    assert "| posA_lowP_lowH | 0.2 | 3.5 | 0.5 |" in out and "| negA_highP_lowH | 0 | - | - |" in out
    assert "posA_lowP_lowH is the set S2T silences" in out
    assert (tmp_path / "t.png").stat().st_size > 10_000