"""curves.py: the panels from run folders, the silenced-token table, and a clear error without matplotlib."""
import json
import math
import os
import subprocess
import sys

import pytest

import curves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
            f.write(json.dumps({"step": 1, "token": token, "p": 0.01, "H": 0.2, "left": "", "right": ""})
                    + "\n")
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
    """Token shares average over steps; gradient norm and entropy change average weighted by each step's
    share. By hand for one group: shares .1 and .3, norms 2 and 4 -> (.1 * 2 + .3 * 4) / .4 = 3.5. A step
    with no tau_h in any mini-batch (taxonomy/split 0) has no groups and is left out, not counted as empty
    groups."""
    a = run_folder(tmp_path / "stapo", 3, ["x"])
    rows = [json.loads(x) for x in open(a / "metrics.jsonl")]
    for r, share, norm, dh in zip(rows, (0.1, 0.3, 0.0), (2.0, 4.0, None), (-1.0, 1.0, None)):
        for g in curves.taxonomy_groups()[0]:
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

def test_importing_curves_loads_no_torch():
    """curves.py needs torch only for the taxonomy's group names (analysis.py's GROUPS), read on first use."""
    code = "import curves, sys; assert 'torch' not in sys.modules; assert 'analysis' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    import analysis
    assert curves.taxonomy_groups() == (analysis.GROUPS, analysis.SPURIOUS)  # one definition, analysis.py's


# Student's t at 97.5% (the 95% interval's factor) for df degrees of freedom, to 7 digits
T975 = {1: 12.7062047, 2: 4.3026527, 3: 3.1824463, 4: 2.7764451, 9: 2.2621572, 16: 2.1199053,
        29: 2.0452296, 30: 2.0422725, 100: 1.9839715}


def test_t_quantile_is_students_for_any_degrees_of_freedom():
    """The tables' values (12.706, 4.303, 2.776, 2.262, 2.045, 1.984 for df 1, 2, 4, 9, 29, 100; 16 and 30
    were gaps of the table it replaces, which fell back to 1.96), the closed forms of df 1 and 2 at other
    levels, the symmetry, and the normal's 1.95996 as df grows."""
    for df, t in T975.items():
        assert curves.t_quantile(0.975, df) == pytest.approx(t, abs=2e-7), df
        assert curves.t975(df + 1) == curves.t_quantile(0.975, df)
    for p in (0.6, 0.8, 0.9, 0.99, 0.9995):
        assert curves.t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)
        assert curves.t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9)
        assert curves.t_quantile(1 - p, 7) == -curves.t_quantile(p, 7)
    assert curves.t_quantile(0.8, 4) == pytest.approx(0.9409646, abs=1e-6)
    assert curves.t_quantile(0.975, 10 ** 6) == pytest.approx(1.959966, abs=1e-5)
    with pytest.raises(ValueError):
        curves.t_quantile(0.975, 0)


def test_a_band_is_the_t_interval_of_its_own_number_of_runs(tmp_path, monkeypatch):
    """band() and draw_bands: the half-width is t975(n) standard errors for the n runs of that group, whatever
    n is (2 runs: 12.706; 3 runs: 4.303), not one n's factor for every group; and a band stops at 0, since no
    panel's quantity can be negative (a band below 0 drew entropies and counts that cannot be)."""
    mean, half = curves.band([[1.0, 2.0], [3.0, 5.0]])
    assert mean == [2.0, 3.5] and half == pytest.approx([12.7062047 * 1.0, 12.7062047 * 1.5], rel=1e-7)
    assert curves.band([[1.0, 2.0]]) == ([1.0, 2.0], [0.0, 0.0])
    pytest.importorskip("matplotlib")
    import matplotlib.axes
    drawn, fill = [], matplotlib.axes.Axes.fill_between

    def recorded(ax, x, lo, hi, **kw):
        drawn.append((lo, hi))
        return fill(ax, x, lo, hi, **kw)
    monkeypatch.setattr(matplotlib.axes.Axes, "fill_between", recorded)
    groups = {}
    for name, accuracies in (("two", (0.2, 0.6)), ("three", (0.1, 0.2, 0.6))):
        groups[name] = []
        for k, acc in enumerate(accuracies):
            folder = tmp_path / f"{name}{k}"
            folder.mkdir()
            (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "accuracy": acc}) + "\n"
                                                          for s in range(1, 4)))
            groups[name].append(str(folder))
    curves.draw_bands(groups, str(tmp_path / "bands.png"), window=1)
    accuracy = drawn[::len(curves.BAND_PANELS)]  # each group's first panel, its training accuracy
    assert len(accuracy) == 2
    for (lo, hi), values in zip(accuracy, ((0.2, 0.6), (0.1, 0.2, 0.6))):
        n, m = len(values), sum(values) / len(values)
        se = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1) / n)
        assert [h - m for h in hi] == pytest.approx([T975[n - 1] * se] * 3, rel=1e-6), n
        assert list(lo) == pytest.approx([max(m - T975[n - 1] * se, 0.0)] * 3, rel=1e-6) and min(lo) == 0.0
    assert (tmp_path / "bands.png").stat().st_size > 10_000
