"""examples/toy_compare.py's statistics, without running the toy: the t-interval for any number of seeds, and
the paired row, which pairs runs by their seed and names the seeds it leaves out."""
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import toy_compare  # noqa: E402


@pytest.mark.parametrize("n, t", [(2, 12.7062047), (3, 4.3026527), (5, 2.7764451), (10, 2.2621572),
                                  (17, 2.1199053), (30, 2.0452296), (31, 2.0422725), (101, 1.9839715)])
def test_the_interval_uses_students_t_for_its_own_number_of_seeds(n, t):
    """Half-width t(0.975, n - 1) * sd / sqrt(n) for any n: 17 and 31 seeds were gaps of the old table,
    which gave them 1.96 (an interval about 8% too narrow)."""
    xs = [k % 3 / 10 for k in range(n)]
    mean = sum(xs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    assert toy_compare.interval(xs) == pytest.approx((mean, t * sd / math.sqrt(n)), rel=1e-7)


def test_the_paired_row_pairs_runs_by_seed_not_by_order():
    """Each objective's runs in another seed order, and a seed that only one objective finished: the paired
    row is the mean and interval of the per-seed differences over the seeds both have, and a line names the
    seeds left out."""
    stapo = {3: {"acc": 0.9}, 1: {"acc": 0.8}, 2: {"acc": 1.0}, 7: {"acc": 0.5}}
    justrl = {1: {"acc": 0.7}, 2: {"acc": 0.8}, 3: {"acc": 0.95}, 9: {"acc": 0.1}}
    lines = toy_compare.table({"stapo": stapo, "justrl": justrl}, 0.4)
    m, h = toy_compare.interval([0.9 - 0.95, 0.8 - 0.7, 1.0 - 0.8])  # seeds 3, 1, 2
    assert lines[-3] == f"| stapo − justrl, paired by seed | {m:+.3f} ± {h:.3f} |"
    assert lines[-2] == ("(the paired row is over seeds 3, 1, 2; left out, unpaired: seed 7 (stapo only), "
                         "9 (justrl only))")
    assert lines[2].startswith("| stapo (4) | 0.80 ± ") and lines[3].startswith("| justrl (4) | 0.64 ± ")


def test_all_seeds_paired_prints_no_left_out_line_and_too_few_prints_no_paired_row():
    both = {0: {"acc": 0.9}, 1: {"acc": 0.8}}
    lines = toy_compare.table({"stapo": both, "justrl": {1: {"acc": 0.7}, 0: {"acc": 0.8}}}, 0.4)
    assert lines[-2] == "| stapo − justrl, paired by seed | +0.100 ± 0.000 |"  # by order: 0.2 and 0.0
    lines = toy_compare.table({"stapo": both, "justrl": {1: {"acc": 0.7}, 5: {"acc": 0.6}}}, 0.4)
    assert not any("paired by seed |" in line for line in lines)
    assert lines[-2] == ("(the paired row is over seeds 1; left out, unpaired: seed 0 (stapo only), "
                         "5 (justrl only))")


RUNS = os.path.join(ROOT, "docs", "toy_runs")
POWER = {"span_explore": ("entropy rise", "24")}  # the protocol's power: its study, column and seeds (docs/toy.md)


STUDIES = sorted(f[:-len(".tar.xz")] for f in os.listdir(RUNS) if f.endswith(".tar.xz") and f != "ladder.tar.xz")


@pytest.mark.parametrize("study", STUDIES)  # the ladder's three runs are docs/ladder.md's (tests/test_docs.py)
def test_every_toy_table_is_rebuilt_from_its_committed_runs(study, tmp_path, capsys):
    """Each study's runs are committed (docs/toy_runs/<study>.tar.xz: every run's result.json, metrics.jsonl,
    silenced tokens and log), and `examples/toy_compare.py --table-only` rebuilds from them, line by line, the
    tables docs/toy.md prints for that study (the seed-by-kernel table for a `kernels` study), and for the study
    a protocol's power rests on, its power line. Breaks if a table or the power in the docs was edited by hand,
    or the runs that made it were not the ones committed."""
    import tarfile
    with tarfile.open(os.path.join(RUNS, f"{study}.tar.xz")) as archive:
        archive.extractall(tmp_path, filter="data")
    folders = sorted(os.listdir(tmp_path / study))
    seeds = sorted({int(f.rsplit("_s", 1)[1]) for f in folders if "_s" in f})
    methods = list(dict.fromkeys(f.rsplit("_s", 1)[0] for f in folders if "_s" in f))
    argv = ["--out", str(tmp_path / study), "--seeds", ",".join(map(str, seeds)), "--table-only"]
    power = ["--power", POWER[study][0], "--power-seeds", POWER[study][1]] if study in POWER else []
    if study.startswith("kernels"):
        lines = toy_compare.main(argv + ["--kernels"])
    else:
        arms = [m for m in ("stapo", "justrl", "control") if m in methods]
        toy_compare.main(argv + ["--methods", ",".join(arms)] + power)
        lines = capsys.readouterr().out.splitlines()[:-1]  # the figure's path last
    doc = open(os.path.join(ROOT, "docs", "toy.md")).read().splitlines()
    missing = [line for line in lines if line.startswith(("|", "power:")) and line not in doc]
    assert len([x for x in lines if x.startswith("|")]) >= 5 and not missing, "\n".join(missing)
    assert not power or any(line.startswith("power:") for line in lines)


@pytest.mark.parametrize("effect, n, power", [(1.0, 10, 0.8031), (0.5, 34, 0.8078), (0.8, 15, 0.8213),
                                              (0.51, 5, 0.1441), (0.0, 10, 0.05), (0.0, 2, 0.05)])
def test_the_power_of_a_paired_t_test_is_the_noncentral_ts(effect, n, power):
    """curves.paired_t_power: P(|T| > t(0.975, n - 1)) for T noncentral t (n - 1 df, noncentrality d sqrt(n)),
    against G*Power's values for the paired t-test (d_z 1 on 10 pairs: 0.8031; 0.5 on 34: 0.8078; 0.8 on 15:
    0.8213), the audit's n = 5 figure (0.14), and alpha itself at d = 0 (df 1 included, where the chi density
    is not 0 at 0). Breaks if the noncentrality missed its sqrt(n), or the critical value were z's."""
    import curves
    assert curves.paired_t_power(effect, n) == pytest.approx(power, abs=5e-4)
    assert curves.paired_t_power(-effect, n) == curves.paired_t_power(effect, n)


def test_the_detectable_effect_has_the_asked_power_and_the_power_line_reads_the_paired_differences():
    """detectable_effect(n) is the d_z found with 80% power (1.00 on 10 pairs, 3.76 / sqrt(5) on 5); the
    power line takes the first two arms' per-seed differences in the column, paired by seed."""
    import curves
    assert curves.paired_t_power(curves.detectable_effect(10), 10) == pytest.approx(0.8, abs=1e-6)
    assert curves.detectable_effect(10) == pytest.approx(0.996, abs=2e-3)
    a = {0: {"x": 0.1}, 1: {"x": 0.3}, 2: {"x": 0.2}}
    b = {2: {"x": 0.5}, 0: {"x": 0.2}, 1: {"x": 0.6}, 7: {"x": 9.0}}
    line = toy_compare.power_line({"stapo": a, "justrl": b}, "x", 10)
    s = math.sqrt(((-0.1 - -0.7 / 3) ** 2 + 2 * (-0.3 - -0.7 / 3) ** 2) / 2)
    assert line.startswith(f"power: x, stapo − justrl over seeds 0, 1, 2: d = {-0.7 / 3:+.4f}, s = {s:.4f}")
    assert f"has power {curves.paired_t_power(-0.7 / 3 / s, 10):.3f} for it" in line


def test_run_on_is_the_truncated_share_of_the_last_steps(tmp_path):
    """run_on: the mean of `truncated` over a run's last 50 steps (answers cut at the limit after their box);
    run_on_line gives each objective's mean and interval over seeds. Breaks if it read the whole run."""
    import json
    folder = tmp_path / "run"
    (folder / "rl").mkdir(parents=True)
    rows = [{"step": s, "truncated": 0.0 if s <= 100 else 1.0} for s in range(1, 126)]  # the last 25 cut
    (folder / "rl" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert toy_compare.run_on(str(folder)) == pytest.approx(0.5)
    line = toy_compare.run_on_line({"stapo": {0: 0.5, 1: 0.7}, "justrl": {0: 0.1}})
    m, h = toy_compare.interval([0.5, 0.7])
    assert line.endswith(f"stapo {m:.2f} ± {h:.2f}, justrl 0.10)")
