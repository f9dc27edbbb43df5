"""curves.py: the paper's panels from run folders, what S2T silenced, and the token-level analysis.

    python curves.py runs/stapo runs/grpo --out curves.png          # one line per run, steps on x
    python curves.py --silenced runs/stapo runs/justrl --out silenced.png
    python curves.py --taxonomy runs/stapo runs/justrl --out taxonomy.png

A run folder is what `stapo.py --out` writes: metrics.jsonl (one line per step) and silenced.jsonl (one
line per silenced token: the token, its p and H). The silenced view prints the most frequent silenced
tokens of each run as a table (it diffs between runs) and draws the p and H histograms: the paper's
word-cloud analysis in a form that compares. The taxonomy view sorts the tokens into the paper's groups on
S2T's own thresholds (A > 0 or < 0, p below or above tau_p, H below or above the mini-batch's tau_h, so that
posA_lowP_lowH is the set S2T silences; the four posA groups are the late paper's, the four negA ones complete
the early version's eight) and draws each group's share of the tokens, the mean norm of its policy-gradient
term on the logits, and its mean entropy change (the paper's lemma), over all steps of each run.
matplotlib is imported only here, only when drawing; analysis.py (and with it torch) only by the taxonomy's
functions, so `import curves` loads neither.
"""
import argparse, collections, functools, json, math, os, sys

# (panel title, [(metrics.jsonl key, line label)], y-axis label)
PANELS = [
    ("Accuracy and reward", [("accuracy", "accuracy"), ("reward_mean", "reward")], ""),
    ("Token entropy", [("entropy_mean", None)], "nats"),
    ("Response length", [("response_len_mean", None)], "tokens"),
    ("Silenced tokens", [("silenced_frac", None)], "fraction of response tokens"),
    ("Entropy threshold τ_h", [("tau_h", None)], "nats"),
    ("Clip fractions", [("clip_low", "low"), ("clip_high", "high")], "fraction of kept tokens"),
    ("Grad norm", [("grad_norm", None)], "before clipping"),
    ("Share of the logit gradient", [("grad_share/silenced", "silenced"), ("grad_share/silenced_if_kept",
                                     "silenced, if kept"), ("grad_share/candidates_kept", "candidates kept")],
     "of sum ||grad||^2 the loss applies"),
    ("Held-out accuracy (--eval-every)", [("eval/average", None)], "avg@k (%)"),
]
STYLES = ["-", "--", ":"]


def pyplot():
    try:
        import matplotlib
    except ImportError:
        sys.exit("curves.py draws with matplotlib, which is not installed: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def taxonomy_groups():
    """(GROUPS, SPURIOUS): analysis.py's eight token groups and the one S2T silences, imported on first use
    (analysis imports torch; the curves and the bands need neither)."""
    from analysis import GROUPS, SPURIOUS
    return GROUPS, SPURIOUS


@functools.lru_cache(maxsize=None)
def t_quantile(p, df):
    """Student's t quantile: the x with P(T <= x) = p for T of df degrees of freedom (df >= 1, 0 < p < 1).
    With T = sqrt(df) tan(u), P(0 < T < sqrt(df) tan(U)) = c * integral of cos(u)^(df - 1) from 0 to U, where
    c = Gamma((df + 1) / 2) / (sqrt(pi) Gamma(df / 2)): a smooth integrand on [0, pi/2), integrated by
    Simpson's rule (512 panels) and solved for U by bisection. test_curves.py holds it to 2e-7 of 7-digit
    tables (their rounding) and to 1e-9 of the closed forms of df 1 and 2."""
    if not (0 < p < 1 and df >= 1):
        raise ValueError(f"t_quantile needs 0 < p < 1 and df >= 1, not p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(math.pi)

    def mass(u, panels=512):  # P(0 < T < sqrt(df) tan(u))
        h = u / panels
        weights = (1 if k in (0, panels) else 4 if k % 2 else 2 for k in range(panels + 1))
        return c * h / 3 * sum(w * math.cos(k * h) ** (df - 1) for k, w in enumerate(weights))
    top = 1.0  # a bracket in t: the panels stay narrow beside the integrand's peak (its width ~ 1/sqrt(df))
    while mass(math.atan(top / math.sqrt(df))) < p - 0.5:
        top *= 2
    lo, hi = 0.0, math.atan(top / math.sqrt(df))
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mass(mid) < p - 0.5 else (lo, mid)
    return math.sqrt(df) * math.tan((lo + hi) / 2)


def normal_cdf(x):
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def paired_t_power(effect, n, alpha=0.05, panels=2000):
    """The power of a two-sided paired t-test at level alpha on n pairs against a true mean difference of
    `effect` standard deviations of the differences (Cohen's d_z): P(|T| > t(1 - alpha/2, n - 1)), T noncentral
    t with n - 1 degrees of freedom and noncentrality effect * sqrt(n). With V ~ chi^2(df) and Z normal,
    T = (Z + delta) / sqrt(V / df), so the power is E_V[Phi(delta - c sqrt(V/df)) + Phi(-delta - c sqrt(V/df))];
    integrated over u = sqrt(V) (a smooth integrand) by Simpson's rule. test_toy_compare.py holds it to
    published values (d_z = 1 on 10 pairs: 0.803) and to alpha at effect 0."""
    df, delta = n - 1, abs(effect) * math.sqrt(n)
    c, top = t_quantile(1 - alpha / 2, df), math.sqrt(df) + 12
    log_k = math.log(2) - (df / 2) * math.log(2) - math.lgamma(df / 2)  # density of u: k u^(df-1) e^(-u^2/2)
    h, total = top / panels, 0.0
    for i in range(panels + 1):
        u = i * h
        density = math.exp(log_k + (df - 1) * math.log(u) - u * u / 2) if u > 0 else (math.exp(log_k) if df == 1 else 0)
        s = c * u / math.sqrt(df)
        w = 1 if i in (0, panels) else 4 if i % 2 else 2
        total += w * density * (normal_cdf(delta - s) + normal_cdf(-delta - s))
    return total * h / 3


def detectable_effect(n, power=0.8, alpha=0.05):
    """The smallest effect (in standard deviations of the differences) that a paired t-test on n pairs finds
    with the given power (paired_t_power, solved by bisection)."""
    lo, hi = 0.0, 20.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if paired_t_power(mid, n, alpha) < power else (lo, mid)
    return (lo + hi) / 2


def t975(n):
    """The t factor of a 95% interval on a mean over n values (n - 1 degrees of freedom); n >= 2."""
    return t_quantile(0.975, n - 1)


def read_jsonl(path):
    if not os.path.exists(path):
        sys.exit(f"{path}: no such file (is {os.path.dirname(path)} a stapo.py --out folder?)")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def smooth(ys, window):
    """Trailing moving average over `window` steps (1: as logged)."""
    out = []
    for i in range(len(ys)):
        part = ys[max(0, i - window + 1):i + 1]
        out.append(sum(part) / len(part))
    return out


def series(rows, key):
    """(steps, values) of one metric, skipping the steps that lack it (tau_h with nothing to silence)."""
    points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def draw_curves(runs, out, window=1):
    plt = pyplot()
    metrics = {name: read_jsonl(os.path.join(path, "metrics.jsonl")) for name, path in runs.items()}
    panels = [p for p in PANELS if any(series(rows, k)[0] for rows in metrics.values() for k, _ in p[1])]
    cols = 4 if len(panels) > 4 else len(panels)
    rows_n = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.4 * rows_n), squeeze=False)
    for ax, (title, keys, ylabel) in zip(axes.flat, panels):
        for color, (name, rows) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], metrics.items()):
            for style, (key, label) in zip(STYLES, keys):
                steps, values = series(rows, key)
                ax.plot(steps, smooth(values, window), style, color=color,
                        label=name if label is None else f"{name} {label}")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}: {len(panels)} panels, {len(runs)} runs")


def silenced_table(tokens, top):
    """Markdown: the `top` most frequent silenced tokens of each run, with counts, side by side."""
    counts = {name: collections.Counter(r["token"] for r in recs) for name, recs in tokens.items()}
    lines = ["| rank | " + " | ".join(f"{name} (of {sum(c.values())})" for name, c in counts.items()) + " |",
             "|---" * (len(counts) + 1) + "|"]
    ranked = {name: c.most_common(top) for name, c in counts.items()}
    for i in range(max(map(len, ranked.values()), default=0)):
        cells = [f"`{repr(r[i][0])[1:-1]}` {r[i][1]}" if i < len(r) else "" for r in ranked.values()]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def draw_silenced(runs, out, top=20):
    tokens = {name: read_jsonl(os.path.join(path, "silenced.jsonl")) for name, path in runs.items()}
    print(silenced_table(tokens, top))
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, label in ((axes[0], "p", "probability p of the silenced token"),
                           (axes[1], "H", "entropy H at the silenced token (nats)")):
        for name, recs in tokens.items():
            ax.hist([r[key] for r in recs], bins=30, alpha=0.5, label=f"{name} ({len(recs)})")
        ax.set_xlabel(label)
        ax.set_ylabel("silenced tokens")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


MEASURES = [("tokens", "share of the tokens"), ("grad_norm", "mean ||grad|| of r A log p on the logits"),
            ("dH", "mean entropy change (the paper's lemma)")]


def taxonomy(rows):
    """{group: {measure: value}} over a run's steps: token shares averaged over the steps; the gradient
    norm and the entropy change averaged over the steps, weighted by the group's share of each step. The
    steps in which no mini-batch had a tau_h (taxonomy/split 0: no S2T candidate) have no groups."""
    out, rows = {}, [r for r in rows if r.get("taxonomy/split")]
    for g in taxonomy_groups()[0]:
        share = [r.get(f"taxonomy/{g}/tokens") or 0.0 for r in rows]
        weighted = {m: [(s, r[f"taxonomy/{g}/{m}"]) for s, r in zip(share, rows)
                        if r.get(f"taxonomy/{g}/{m}") is not None] for m in ("grad_norm", "dH")}
        out[g] = {"tokens": sum(share) / max(len(share), 1)}
        for m, pairs in weighted.items():
            total = sum(s for s, _ in pairs)
            out[g][m] = sum(s * v for s, v in pairs) / total if total else None
    return out


def taxonomy_table(runs):
    """Markdown: one row per group, each run's token share, mean gradient norm and entropy change."""
    GROUPS, SPURIOUS = taxonomy_groups()
    head = "| group | " + " | ".join(f"{n}: tokens | {n}: mean grad | {n}: dH" for n in runs) + " |"
    lines = [head, "|---" * (1 + 3 * len(runs)) + "|"]
    for g in GROUPS:
        cells = []
        for t in runs.values():
            cells += [f"{t[g]['tokens']:.3g}"] + ["-" if t[g][m] is None else f"{t[g][m]:.3g}"
                                                 for m in ("grad_norm", "dH")]
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    lines.append(f"\n{SPURIOUS} is the set S2T silences; the posA groups are the late paper's four, the negA "
                 "ones complete the early version's eight.")
    return "\n".join(lines)


def draw_taxonomy(runs, out):
    tables = {name: taxonomy(read_jsonl(os.path.join(path, "metrics.jsonl"))) for name, path in runs.items()}
    print(taxonomy_table(tables))
    GROUPS = taxonomy_groups()[0]
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / len(tables)
    for ax, (m, label) in zip(axes, MEASURES):
        for k, (name, t) in enumerate(tables.items()):
            values = [t[g][m] or 0.0 for g in GROUPS]
            ax.bar([i + k * width for i in range(len(GROUPS))], values, width, label=name)
        ax.set_xticks([i + width * (len(tables) - 1) / 2 for i in range(len(GROUPS))])
        ax.set_xticklabels([g.replace("_", "\n") for g in GROUPS], fontsize="small")
        ax.set_title(label)
        ax.set_yscale("linear" if m == "dH" else "log")  # shares and norms span five decades
        ax.axhline(0, color="grey", lw=0.5)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


BAND_PANELS = [("Training accuracy", "accuracy", ""), ("Token entropy", "entropy_mean", "nats"),
               ("S2T's set (A > 0, p < τ_p, H < τ_h)", "s2t_set", "per 10^4 tokens with A ≠ 0"),
               ("Its share of the gradient, were it kept", "grad_share/silenced_if_kept", "of Σ||∇_a||²")]


def band_series(rows, key):
    """One run's per-step values of a BAND_PANELS key (s2t_set: the taxonomy's spurious group, per 1e4)."""
    if key == "s2t_set":
        return [1e4 * (r.get("taxonomy/posA_lowP_lowH/tokens") or 0.0) * r.get("taxonomy/split", 0.0)
                for r in rows]
    return [r.get(key) or 0.0 for r in rows]


def band(ys):
    """ys: one series per run (seed), all as long. Per step: the mean over the n runs, and the half-width of
    its 95% t-interval, t975(n) standard errors (0 for one run)."""
    n = len(ys)
    mean = [sum(col) / n for col in zip(*ys)]
    if n < 2:
        return mean, [0.0] * len(mean)
    t = t975(n)
    half = [t * math.sqrt(sum((v - m) ** 2 for v in col) / (n - 1) / n) for col, m in zip(zip(*ys), mean)]
    return mean, half


def draw_bands(groups, out, window=10):
    """groups: {name: [run folders, one per seed]}. Per panel, each group's mean over its runs of the
    `window`-step mean of a metric, with its 95% t-interval as a band (band(): Student's t for that group's
    own number of runs)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(BAND_PANELS), figsize=(4.2 * len(BAND_PANELS), 3.4))
    for color, (name, runs) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], groups.items()):
        rows = [read_jsonl(os.path.join(run, "metrics.jsonl")) for run in runs]
        n = min(map(len, rows))
        for ax, (title, key, ylabel) in zip(axes, BAND_PANELS):
            mean, half = band([smooth(band_series(r[:n], key), window) for r in rows])
            steps = list(range(1, n + 1))
            ax.plot(steps, mean, color=color, label=f"{name} ({len(runs)} seeds)")
            low = [max(m - h, 0.0) for m, h in zip(mean, half)]  # every panel's quantity is >= 0: so is its band
            ax.fill_between(steps, low, [m + h for m, h in zip(mean, half)], color=color, alpha=0.25)
            ax.set(title=title, xlabel="step", ylabel=ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders (stapo.py --out); NAME=FOLDER names a run")
    p.add_argument("--out", help="the PNG (default: curves.png, or silenced.png with --silenced)")
    p.add_argument("--silenced", action="store_true", help="what S2T silenced, instead of the curves")
    p.add_argument("--taxonomy", action="store_true", help="the token groups on S2T's thresholds instead")
    p.add_argument("--smooth", type=int, default=1, help="moving average over this many steps")
    p.add_argument("--top", type=int, default=20, help="silenced tokens listed per run")
    a = p.parse_args(argv)
    runs = dict(r.split("=", 1) if "=" in r else (os.path.basename(os.path.normpath(r)), r) for r in a.runs)
    if a.silenced:
        draw_silenced(runs, a.out or "silenced.png", a.top)
    elif a.taxonomy:
        draw_taxonomy(runs, a.out or "taxonomy.png")
    else:
        draw_curves(runs, a.out or "curves.png", max(1, a.smooth))


if __name__ == "__main__":
    main()
