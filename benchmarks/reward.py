"""The checker on a corpus built from the six benchmarks' golds, side by side with Math-Verify when present.

    python benchmarks/reward.py [--data ../shared/data/benchmarks] [--show-misses]

For every gold g the corpus holds the renderings a model writes for it, which must be judged right (other
spellings, orders, sets, units, named forms), and near misses, which must be judged wrong (a digit moved,
the sign flipped, the value doubled, an item dropped, a letter's case changed). Each pair is checked with
reward.is_equivalent(pred, gold), and with Math-Verify's verify(parse(gold), parse(pred)) when `math_verify`
imports (install it in a separate environment: it is never a dependency of this project). Prints
agreement with the labels per rule, answers per second for both, and the pairs where the two disagree.
"""
import argparse, collections, json, os, re, sys, time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # record.py
from reward import _split_top, is_equivalent, normalize, number  # noqa: E402

NAMES = ["aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench"]


def value(g):
    """The exact value of a plain-number gold, else None."""
    try:
        n = number(g)
    except ValueError:
        return None
    return n[0] if n and n[1] else None


def items(g):
    """The top-level comma items of a list gold, or None (a thousands number or a single tuple is no list)."""
    parts = _split_top(g, [","])
    if len(parts) < 2 or value(normalize(g)) is not None or "..." in g or " where " in g:
        return None
    return parts


def renderings(g):
    """[(rule, pred)] that must be judged equal to g."""
    out = [("same string", g), ("in $...$", "$%s$" % g), ("\\dfrac", g.replace("\\frac", "\\dfrac"))]
    v, parts = value(g), items(g)
    if v is not None:
        out.append(("named: x = g", "x = %s" % g))
        out.append(("with a unit", "%s \\text{ units}" % g))
        if v.denominator != 1:
            out.append(("as a decimal", "%.8g" % float(v)))
        if v.denominator == 1 and abs(v) >= 1000:
            out.append(("thousands separators", "{:,}".format(int(v))))
        if v.denominator == 1 and 0 < v < 360 and "\\frac" not in g:
            out.append(("degrees", "%s^{\\circ}" % g))
    m = re.fullmatch(r"(-?\d+(?:\.\d+)?)e(-?\d+)", g)
    if m:
        out.append(("\\times 10^{n}", "%s \\times 10^{%s}" % m.groups()))
    if parts:
        out.append(("list reversed", ", ".join(reversed(parts))))
        out.append(("as a set", "\\{%s\\}" % ", ".join(parts)))
        out.append(("with `and`", "%s, and %s" % (", ".join(parts[:-1]), parts[-1])))
    if re.fullmatch(r"\([^()]*\)", g) and "," in g:
        out.append(("named tuple", "(x, y%s) = %s" % (", z" * (g.count(",") - 1), g)))
        out.append(("\\left( \\right)", "\\left(%s\\right)" % g[1:-1]))
    if re.search(r"\\sqrt\{\d\}", g):
        out.append(("\\sqrt n", re.sub(r"\\sqrt\{(\d)\}", r"\\sqrt \1", g)))
    return out


def near_misses(g):
    """[(rule, pred)] that must be judged different from g."""
    out, v, parts = [], value(g), items(g)
    m = re.search(r"\d", g)
    if m and not (parts or "," in g):
        out.append(("a digit moved", g[:m.start()] + str((int(m.group()) + 1) % 10) + g[m.end():]))
    if v is not None and v != 0:
        out.append(("sign flipped", str(-v) if v.denominator == 1 else "-(%s)" % g))
        out.append(("doubled", str(2 * v)))
    if parts and len(set(parts)) == len(parts):
        out.append(("an item dropped", ", ".join(parts[:-1])))
    letter = re.search(r"(?<![\\a-zA-Z])([a-zA-Z])(?![a-zA-Z])", g)
    if letter and letter.group(1) not in "eiE":
        swapped = letter.group(1).swapcase()
        if swapped not in g:
            out.append(("a letter's case", g[:letter.start()] + swapped + g[letter.end():]))
    return out


def load_golds(data):
    golds = []
    for name in NAMES:
        with open(os.path.join(data, name + ".jsonl")) as f:
            golds += [(name, json.loads(line)["answer"]) for line in f if line.strip()]
    return golds


def math_verify_checker():
    try:
        from math_verify import parse, verify
    except ImportError:
        return None

    def check(pred, gold):
        try:
            return bool(verify(parse("$%s$" % gold), parse("\\boxed{%s}" % pred)))
        except Exception:
            return False
    return check


def settings(mv):
    """Both checkers' settings, as measured: one process, one checker after the other, the same pairs."""
    from importlib.metadata import version
    out = "stapo: reward.is_equivalent(pred, gold), timeout 5 s, REL_TOL 1e-4"
    if mv:
        out += (f"; Math-Verify {version('math-verify')}: verify(parse('$gold$'), parse('\\boxed{{pred}}')), "
                "its defaults (float_rounding=6, strict=True, timeouts 5 s)")
    return out + "; one process, one checker after the other"


def timed(check, corpus):
    t0 = time.perf_counter()
    verdicts = [check(pred, gold) for _, _, _, gold, pred in corpus]
    return verdicts, len(corpus) / (time.perf_counter() - t0)


def main():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.path.join(here, "..", "shared", "data", "benchmarks"),
                   help="the benchmarks' .jsonl files")
    p.add_argument("--show-misses", action="store_true", help="print every pair a checker gets wrong")
    import record
    record.add_flag(p)
    a = p.parse_args()
    with record.kept(a.results, "reward"):
        golds = load_golds(a.data)
        corpus = [(True, rule, name, g, pred) for name, g in golds for rule, pred in renderings(g)]
        corpus += [(False, rule, name, g, pred) for name, g in golds for rule, pred in near_misses(g)]
        checkers = {"stapo": lambda pred, gold: is_equivalent(pred, gold)}
        mv = math_verify_checker()
        if mv:
            checkers["Math-Verify"] = mv
        is_equivalent("x+1", "x+1.5")  # start the sympy worker outside the timing
        results = {name: timed(check, corpus) for name, check in checkers.items()}
        print(f"{len(corpus)} pairs from {len(golds)} golds of {len(NAMES)} benchmarks "
              f"({sum(c[0] for c in corpus)} renderings, {sum(not c[0] for c in corpus)} near misses)")
        print(settings(mv) + "\n")
        print("| kind | rule | pairs | " + " | ".join(f"{n} agrees" for n in results) + " |")
        print("|---|---|---|" + "---|" * len(results))
        groups = collections.defaultdict(list)
        for i, c in enumerate(corpus):
            groups[(c[0], c[1])].append(i)
        for want in (True, False):
            for (w, rule), idx in groups.items():
                if w == want:
                    cells = [f"{sum(v[i] == want for i in idx)}" for v, _ in results.values()]
                    kind = "rendering" if want else "near miss"
                    print(f"| {kind} | {rule} | {len(idx)} | " + " | ".join(cells) + " |")
        cells = [f"**{100 * sum(v[i] == c[0] for i, c in enumerate(corpus)) / len(corpus):.2f}%**"
                 for v, _ in results.values()]
        print(f"| **all** | | **{len(corpus)}** | " + " | ".join(cells) + " |")
        print("\n| checker | answers/s |\n|---|---|")
        for name, (_, speed) in results.items():
            print(f"| {name} | {speed:,.0f} |")
        if a.show_misses or mv:
            for name, (v, _) in results.items():
                wrong = [c for i, c in enumerate(corpus) if v[i] != c[0]]
                print(f"\n{name}: {len(wrong)} pairs judged against the label")
                for want, rule, bench, g, pred in wrong if a.show_misses else []:
                    print(f"    [{rule}] {bench} gold={g!r} pred={pred!r} want={want}")


if __name__ == "__main__":
    main()
