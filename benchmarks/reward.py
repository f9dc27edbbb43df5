"""Reward throughput and sanity on every gold of the six benchmarks.

    python benchmarks/reward.py [--data ../shared/data/benchmarks]

For each gold g it scores a completion ending in \\boxed{g} (expected +1) and one ending in a perturbed
wrong form (expected -1): the first digit of g moved up by one (9 -> 0), or, with no digit, an x appended.
Prints answers per second, mean and p99 latency, and the fraction judged right for each kind.
"""
import argparse, json, os, re, statistics, sys, time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from reward import score  # noqa: E402

NAMES = ["aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench"]


def perturb(gold):
    m = re.search(r"\d", gold)
    if not m:
        return gold + "x"
    return gold[:m.start()] + str((int(m.group()) + 1) % 10) + gold[m.end():]


def main():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.path.join(here, "..", "shared", "data", "benchmarks"))
    a = p.parse_args()
    golds = []
    for name in NAMES:
        with open(os.path.join(a.data, name + ".jsonl")) as f:
            golds += [(name, json.loads(line)["answer"]) for line in f if line.strip()]
    score("\\boxed{x+1}", "x+1.5")  # start the sympy worker outside the timing
    res = {"self": [], "perturbed": []}
    for name, gold in golds:
        for kind, pred in (("self", gold), ("perturbed", perturb(gold))):
            t0 = time.perf_counter()
            s = score("Let us think. ... So the answer is $\\boxed{%s}$." % pred, gold)
            res[kind].append((time.perf_counter() - t0, s, name, gold, pred))
    print(f"{len(golds)} golds from {len(NAMES)} benchmarks")
    print("| completions | answers/s | mean latency (ms) | p99 latency (ms) | judged right |\n|---|---|---|---|---|")
    for kind, want in (("self", 1.0), ("perturbed", -1.0)):
        lat = sorted(r[0] for r in res[kind])
        right = sum(r[1] == want for r in res[kind]) / len(lat)
        print(f"| {kind:9} | {len(lat) / sum(lat):.0f} | {1e3 * statistics.mean(lat):.2f} | "
              f"{1e3 * lat[int(0.99 * (len(lat) - 1))]:.1f} | {100 * right:.2f}% |")
        for r in res[kind]:
            if r[1] != want:
                print(f"    {kind} judged wrong: {r[2]} gold={r[3]!r} pred={r[4]!r}")


if __name__ == "__main__":
    main()
