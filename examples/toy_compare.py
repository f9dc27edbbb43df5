"""The CPU toy's arms over seeds: STAPO against JustRL (and the positive control), what silencing does.

    python examples/toy_compare.py --out runs/span --methods stapo,justrl,control   # the span world, seeds 0-4
    python examples/toy_compare.py --out runs/span --table-only --power "entropy rise" --power-seeds 10
    python examples/toy_compare.py --kernels --seeds 0,1,2,3,4 --out runs/kernels   # STAPO per kernel setting
    python examples/toy_compare.py --world add --out runs/compare                   # the earlier world's study

One warm start (examples/toy.py's, built once), then one `examples/toy.py --base` process per arm and seed,
--jobs of them at a time, each with OMP_NUM_THREADS=1. Every run's folder is <out>/<arm>_s<seed> (its log in
run.log). A run already finished there (its result.json) is not run again, so a stopped comparison continues
where it stopped. Then it prints one table, the mean and a 95% t-interval over seeds of, for the span world:
  held-out accuracy       greedy, on the toy's 200 problems never trained on
  accuracy drop           the largest fall of the run's 10-step mean training accuracy below its highest so far
  entropy rise            the run's largest rise of its 10-step mean entropy (all response tokens) above its
                          lowest value so far (a blow-up after a fall; 0 when it only falls)
  final entropy           the mean token entropy of the last 10 steps
  span: other tokens' p   after RL, at the held-out prompts, the mean probability of anything but the span's own
                          token at the span's 8 positions (toy.span_stats; the warm start's: 0.016)
  S2T's set per 1e4       the tokens S2T flags (A > 0, p < tau_p, H < tau_h), per 10^4 response tokens with
                          A != 0 (taxonomy/posA_lowP_lowH/tokens x taxonomy/split), over the run
  … in the span (%)       the share of them (silenced.jsonl, every objective's) that fell in the span (toy.region)
  … its H                 their mean entropy (taxonomy/posA_lowP_lowH/entropy), the mean over steps
  grad share (%)          S2T's set's share of the sum of ||grad_a||^2 the loss applies (grad_share/silenced:
                          0 under STAPO, which silences it), and what it would be were the set kept
                          (grad_share/silenced_if_kept), the mean over steps
  … p rose 5 steps on (%) of the sample of each step's set revisited 5 steps later at the same context
                          (s2t_later/*), the share whose p rose
(the add world's runs: held-out accuracy, final entropy, entropy rise, S2T's set per 1e4 over the run and its
first and last quarter, the grad shares), with a last row for the first two arms' difference, seed by seed
(paired: a seed's runs share the warm start, the data order and the samples' seeds), over the seeds both
finished; a seed that only one of them finished is left out of that row, and a line under the table names it.
A second table gives each run's own figures. The t factor is Student's for the row's own number of seeds
(curves.t975). --power COLUMN adds what a paired t-test on --power-seeds seeds can find, given the effect these
runs show (curves.paired_t_power). It draws <out>/bands.png: each arm's mean over seeds with a band (the 95%
t-interval for its number of seeds) per step.
"""
import argparse, json, math, os, subprocess, sys, time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.append(os.path.join(os.path.dirname(HERE), "benchmarks"))
import curves  # noqa: E402
import record  # noqa: E402  the results file of a table (--results)
import toy  # noqa: E402

SPURIOUS = "taxonomy/posA_lowP_lowH/tokens"
KERNELS = ["native", "avx2", "default"]  # ATEN_CPU_CAPABILITY: unset, avx2, default


def interval(xs):
    """(mean, half-width of the 95% t-interval) over seeds; the half-width is None for one value."""
    n, mean = len(xs), sum(xs) / len(xs)
    if n < 2:
        return mean, None
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    return mean, curves.t975(n) * sd / math.sqrt(n)


def spurious_rate(rows):
    """Per step: S2T's set as a fraction of the step's response tokens with A != 0."""
    return [(r.get(SPURIOUS) or 0.0) * r.get("taxonomy/split", 0.0) for r in rows]


def largest_rise(xs):
    """The largest x[j] - x[i] over i <= j: how far the series climbed above its lowest value before (0 if it
    only falls)."""
    low, rise = float("inf"), 0.0
    for x in xs:
        low = min(low, x)
        rise = max(rise, x - low)
    return rise


def entropy_rise(rows, window=10):
    """The largest rise of the run's `window`-step mean entropy above its lowest value before it."""
    return largest_rise(curves.smooth([r["entropy_mean"] for r in rows], window))


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else 0.0


def accuracy_drop(rows, window=10):
    """The largest fall of the run's `window`-step mean training accuracy below its highest value so far."""
    return largest_rise([-x for x in curves.smooth([r["accuracy"] for r in rows], window)])


def run_metrics(folder):
    """One run's row of figures, from its result.json and rl/metrics.jsonl (and rl/silenced.jsonl): the add
    world's columns for a run of it (its result.json names no world), the span world's for the span world's."""
    rows = curves.read_jsonl(os.path.join(folder, "rl", "metrics.jsonl"))
    result = json.load(open(os.path.join(folder, "result.json")))
    rate, q = spurious_rate(rows), max(len(rows) // 4, 1)
    if result.get("world", "add") == "add":
        return {
            "held-out accuracy": result["after"],
            "final entropy": mean(r["entropy_mean"] for r in rows[-10:]),
            "entropy rise": entropy_rise(rows),
            "S2T's set per 1e4": 1e4 * mean(rate),
            "… first quarter": 1e4 * mean(rate[:q]),
            "… last quarter": 1e4 * mean(rate[-q:]),
            "grad share (%)": 100 * mean(r.get("grad_share/silenced") for r in rows),
            "… if kept (%)": 100 * mean(r.get("grad_share/silenced_if_kept") for r in rows),
        }
    found = toy.s2t_set(os.path.join(folder, "rl"))
    where = toy.regions(found, result["span_tokens"])
    later = [(r["s2t_later/tokens"], r["s2t_later/rose"]) for r in rows if r.get("s2t_later/tokens")]
    return {
        "held-out accuracy": result["after"],
        "accuracy drop": accuracy_drop(rows),
        "entropy rise": entropy_rise(rows),
        "final entropy": mean(r["entropy_mean"] for r in rows[-10:]),
        "span: other tokens' p": result["span"]["after"]["span_off"],
        "S2T's set per 1e4": 1e4 * mean(rate),
        "… in the span (%)": 100 * where["span"] / max(len(found), 1),
        "… its H": mean(r.get("taxonomy/posA_lowP_lowH/entropy") for r in rows),
        "grad share (%)": 100 * mean(r.get("grad_share/silenced") for r in rows),
        "… if kept (%)": 100 * mean(r.get("grad_share/silenced_if_kept") for r in rows),
        "… p rose 5 steps on (%)": 100 * sum(n * x for n, x in later) / max(sum(n for n, _ in later), 1),
    }


def table(results, before):
    """Markdown: a row per objective, mean ± half-width over its seeds in each column; results is
    {objective: {seed: its run's figures}}. Then the first two objectives' difference, paired by seed over
    the seeds both have, and a line naming each seed left out of the pairing (finished by one of the two)."""
    columns = list(next(row for runs in results.values() for row in runs.values()))
    lines = [f"| objective (seeds) | {' | '.join(columns)} |", "|---" * (len(columns) + 1) + "|"]
    for method, runs in results.items():
        if not runs:
            lines.append(f"| {method} (0) | " + " | ".join("no run finished" for _ in columns) + " |")
            continue
        cells = []
        for c in columns:
            m, h = interval([r[c] for r in runs.values()])
            digits = 3 if c in ("held-out accuracy", "accuracy drop", "final entropy", "entropy rise",
                                 "span: other tokens' p", "… its H") else 2
            cells.append(f"{m:.{digits}f}" + (f" ± {h:.{digits}f}" if h is not None else ""))
        lines.append(f"| {method} ({len(runs)}) | {' | '.join(cells)} |")
    if len(results) > 1:  # seed by seed: a seed's two runs share the warm start, the data and the samples
        (first, a), (second, b) = list(results.items())[:2]
        both = [s for s in a if s in b]
        if len(both) > 1:
            cells = [interval([a[s][c] - b[s][c] for s in both]) for c in columns]
            row = " | ".join(f"{m:+.3f} ± {h:.3f}" for m, h in cells)
            lines.append(f"| {first} − {second}, paired by seed | {row} |")
        alone = [f"{s} ({first} only)" for s in a if s not in b]
        alone += [f"{s} ({second} only)" for s in b if s not in a]
        if alone:
            lines.append(f"(the paired row is over seeds {', '.join(map(str, both)) or 'none'}; "
                         f"left out, unpaired: seed {', '.join(alone)})")
    lines.append(f"(the warm start: {before:.3f} held out; ± is the 95% t-interval over seeds)")
    return lines


SEED_COLUMNS = {"add": ("held-out accuracy", "entropy rise", "S2T's set per 1e4", "… last quarter"),
                "span": ("held-out accuracy", "accuracy drop", "entropy rise", "span: other tokens' p",
                         "S2T's set per 1e4", "… in the span (%)", "grad share (%)", "… if kept (%)")}


def per_seed(results, columns=None):
    """Markdown: each run's own figures, a row per objective and seed (what the means above are over); the
    columns are the world's (SEED_COLUMNS: the add world's where its runs' figures have no span)."""
    if columns is None:
        some = next(row for runs in results.values() for row in runs.values())
        columns = SEED_COLUMNS["span" if "… in the span (%)" in some else "add"]
    lines = [f"| objective | seed | {' | '.join(columns)} |", "|---" * (len(columns) + 2) + "|"]
    for method, runs in results.items():
        for seed in sorted(runs):
            lines.append(f"| {method} | {seed} | " + " | ".join(f"{runs[seed][c]:.3f}" for c in columns) + " |")
    return lines


def run_on(folder, last=50):
    """The share of a run's responses cut at the length limit (`truncated`) over its last `last` steps: answers
    that ran on past their box (the box is graded, so the run-on is rewarded)."""
    rows = curves.read_jsonl(os.path.join(folder, "rl", "metrics.jsonl"))[-last:]
    return mean(r.get("truncated") for r in rows)


def run_on_line(shares, last=50):
    """One line: each objective's run-on share (run_on), its mean and 95% t-interval over seeds."""
    cells = []
    for method, runs in shares.items():
        m, h = interval(list(runs.values())) if runs else (float("nan"), None)
        cells.append(f"{method} {m:.2f}" + (f" ± {h:.2f}" if h is not None else ""))
    return f"(run-on after the box, the share of the last {last} steps' responses cut at the limit: {', '.join(cells)})"


def power_line(results, column, n):
    """What a paired t-test (two-sided, 5%) on n seeds can find, given the first two objectives' differences in
    `column` over the seeds both have: the mean d and standard deviation s of the differences here, the power for
    a true effect of d (curves.paired_t_power at d / s), and the least |d| it finds with 80% power."""
    (first, a), (second, b) = list(results.items())[:2]
    diffs = [a[s][column] - b[s][column] for s in a if s in b]
    d = sum(diffs) / len(diffs)
    s = math.sqrt(sum((x - d) ** 2 for x in diffs) / (len(diffs) - 1))
    return (f"power: {column}, {first} − {second} over seeds {', '.join(str(x) for x in a if x in b)}: d = {d:+.4f}, "
            f"s = {s:.4f} (d/s = {d / s:+.2f}); a paired t-test on {n} seeds has power "
            f"{curves.paired_t_power(d / s, n):.3f} for it, and 80% power for |d| >= "
            f"{curves.detectable_effect(n) * s:.4f}")


def launch(jobs, at_once):
    """Run each job (command, extra environment, folder) as its own process, at_once of them at a time,
    each on one thread; its output goes to <folder>/run.log."""
    todo, running = (list(jobs) if at_once else []), []
    while todo or running:
        while todo and len(running) < at_once:
            cmd, extra, folder = todo.pop(0)
            env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **extra)
            os.makedirs(folder, exist_ok=True)
            log = open(os.path.join(folder, "run.log"), "w")
            running.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), folder))
            print(f"started {folder} {' '.join(f'{k}={v}' for k, v in extra.items())}", flush=True)
        time.sleep(2)
        for proc, folder in [r for r in running if r[0].poll() is not None]:
            running.remove((proc, folder))
            print(f"{folder}: exit {proc.returncode}", flush=True)
            if proc.returncode:
                sys.exit(f"{folder} failed: see {folder}/run.log")


def toy_command(a, folder, method, seed, base=None):
    """examples/toy.py's command for one arm and seed, with this comparison's settings (the world's where
    none is given)."""
    given = [(flag, getattr(a, key)) for flag, key in (("--steps", "steps"), ("--lr", "lr"), ("--prompts", "prompts"),
             ("--minibatches", "minibatches"), ("--tau-p", "tau_p"), ("--max-tokens", "max_tokens"))
             if getattr(a, key) is not None]
    return [sys.executable, os.path.join(HERE, "toy.py"), "--out", folder, "--method", method, "--seed",
            str(seed), "--world", a.world, "--sft-steps", str(a.sft_steps), "--no-figure"] + \
        [str(x) for pair in given for x in pair] + (["--base", base] if base else []) + (["--hard"] if a.hard else [])


def kernels(a, seeds):
    """--kernels: STAPO per seed under each kernel setting, each setting's warm start its own (built by its
    first seed's run, under that setting; the warm start does not read the seed, so the other seeds start from
    it); the table of held-out accuracies, a row per seed."""
    jobs = [(k, s, os.path.join(a.out, f"{k}_s{s}")) for s in seeds for k in KERNELS]
    env = lambda k: {} if k == "native" else {"ATEN_CPU_CAPABILITY": k}  # noqa: E731
    first = {k: os.path.join(a.out, f"{k}_s{seeds[0]}") for k in KERNELS}
    for stage in (seeds[:1], seeds[1:]):  # the warm starts, then the runs from them
        launch([(toy_command(a, f, "stapo", s, None if s == seeds[0] else os.path.join(first[k], "base")), env(k), f)
                for k, s, f in jobs if s in stage and not os.path.exists(os.path.join(f, "result.json"))],
               0 if a.table_only else a.jobs)
    res = {(k, s): json.load(open(os.path.join(f, "result.json"))) for k, s, f in jobs
           if os.path.exists(os.path.join(f, "result.json"))}
    lines = ["| seed | " + " | ".join(f"{k}: warm start -> after RL" for k in KERNELS) + " |",
             "|---" * (len(KERNELS) + 1) + "|"]
    for s in seeds:
        lines.append(f"| {s} | " + " | ".join(f"{res[k, s]['before']:.3f} -> {res[k, s]['after']:.3f}"
                                             if (k, s) in res else "not run" for k in KERNELS) + " |")
    after = [r["after"] for r in res.values()]
    before = [r["before"] for r in res.values()]
    lines.append(f"(after RL: {min(after):.3f} to {max(after):.3f}; warm start: {min(before):.3f} to "
                 f"{max(before):.3f}; greedy on 200 held-out problems; native = this CPU's default kernels)")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/compare", help="the warm start and each run's folder go here")
    p.add_argument("--methods", default="stapo,justrl", help="comma list of examples/toy.py's arms: stapo.py's "
                   "--method, or control (the positive control)")
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma list of the RL runs' seeds")
    toy.add_world_flags(p)  # --world, its RL settings' overrides, --sft-steps, --hard: each run's, as toy.py's
    p.add_argument("--jobs", type=int, default=2, help="runs at a time, each one process on one thread")
    p.add_argument("--kernels", action="store_true", help="instead: the toy per seed under each kernel "
                   "setting (ATEN_CPU_CAPABILITY unset, avx2, default), each with its own warm start; a "
                   "table of accuracies")
    p.add_argument("--power", metavar="COLUMN", help="also: the power a paired t-test on --power-seeds seeds has "
                   "for the effect these runs show in COLUMN (the first two objectives' difference)")
    p.add_argument("--power-seeds", type=int, default=10, help="the seeds of the design --power is for")
    p.add_argument("--table-only", action="store_true", help="run nothing: the table (and figure) of the "
                   "runs already finished in --out")
    p.add_argument("--results", default="none", help="also write what this prints to a results file in this "
                   "folder (benchmarks/record.py; the README's study figures: benchmarks/results)")
    a = p.parse_args(argv)
    with record.kept(a.results, "toy_compare"):
        return compare(a)


def compare(a):
    """main's work, its flags parsed."""
    methods, seeds = a.methods.split(","), [int(s) for s in a.seeds.split(",")]
    if a.kernels:
        lines = kernels(a, seeds)
        print("\n".join(lines))
        open(os.path.join(a.out, "kernels.md"), "w").write("\n".join(lines) + "\n")
        return lines
    base = os.path.join(a.out, "base")
    ta = toy.parse(["--out", a.out, "--sft-steps", str(a.sft_steps), "--method", methods[0], "--world", a.world]
                   + (["--hard"] if a.hard else []))[1]
    if not a.table_only and not os.path.exists(os.path.join(base, "model.safetensors")):
        toy.prepare(ta)
    jobs = [(m, s, os.path.join(a.out, f"{m}_s{s}")) for s in seeds for m in methods]
    launch([(toy_command(a, f, m, s, base), {}, f) for m, s, f in jobs
            if not os.path.exists(os.path.join(f, "result.json"))], 0 if a.table_only else a.jobs)
    jobs = [j for j in jobs if os.path.exists(os.path.join(j[2], "result.json"))]
    if not jobs:
        sys.exit(f"no run has finished in {a.out} (no <method>_s<seed>/result.json)")
    before = json.load(open(os.path.join(jobs[0][2], "result.json")))["before"]
    results = {m: {s: run_metrics(f) for mm, s, f in jobs if mm == m} for m in methods}
    lines = table(results, before) + [""] + per_seed(results)
    if ta.world == "span":
        lines += ["", run_on_line({m: {s: run_on(f) for mm, s, f in jobs if mm == m} for m in methods})]
    if a.power:
        lines += ["", power_line(results, a.power, a.power_seeds)]
    print("\n".join(lines))
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    groups = {m: [os.path.join(f, "rl") for mm, _, f in jobs if mm == m] for m in methods}
    print(f"the figure: {curves.draw_bands(groups, os.path.join(a.out, 'bands.png'))}")
    return results


if __name__ == "__main__":
    main()
