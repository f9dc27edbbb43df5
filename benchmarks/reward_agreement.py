"""How often the paper's reward (DAPO's strict box) and ours (equivalence) disagree, on the public graders' cases.

    python benchmarks/reward_agreement.py [--show]

tests/data/public_grader_cases.jsonl (benchmarks/public_graders.py describes it) holds, with each case, the
verdict we hold right (`verdict`). Each case with a bare gold answer becomes a completion scored by both
training rewards, reward.score_all(..., reward="equiv") (stapo.py's default) and reward="dapo" (the paper's):
a response (pred "text") as it is, an answer (pred "answer") as "... so the answer is \\boxed{pred}." The
responses without a box score -1 under both (both rewards need one) and are counted apart. Prints, per kind,
the cases both reward, each alone, and neither; how often the two disagree; and how often each agrees with
`verdict`. --show lists the cases they disagree on.
"""
import argparse, collections, json, os, sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # record.py
from reward import score_all  # noqa: E402

CASES = os.path.join(HERE, "tests", "data", "public_grader_cases.jsonl")


def completions(cases):
    """(kind, completion, gold, verdict) of each case with a bare gold."""
    for case in cases:
        if case["gold_kind"] != "answer":
            continue
        if case["pred_kind"] == "answer":
            yield "an answer in a box", f"... so the answer is \\boxed{{{case['pred']}}}.", case
        else:
            kind = "a response with a box" if "\\boxed" in case["pred"] else "a response without a box"
            yield kind, case["pred"], case


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--show", action="store_true", help="list the cases the two rewards disagree on")
    import record
    record.add_flag(p)
    a = p.parse_args(argv)
    with record.kept(a.results, "reward_agreement"):
        with open(CASES) as f:
            rows = list(completions(json.loads(line) for line in f if line.strip()))
        texts, golds = [r[1] for r in rows], [r[2]["gold"] for r in rows]
        equiv, dapo = score_all(texts, golds, "equiv"), score_all(texts, golds, "dapo")
        table = collections.defaultdict(collections.Counter)
        for (kind, _, case), e, d in zip(rows, equiv, dapo):
            for key in (kind, "all"):
                t = table[key]
                t["cases"] += 1
                t[{(1, 1): "both", (1, -1): "equiv only", (-1, 1): "dapo only", (-1, -1): "neither"}[e, d]] += 1
                t["equiv right"] += (e > 0) == bool(case["verdict"])
                t["dapo right"] += (d > 0) == bool(case["verdict"])
        print("| completions | cases | both +1 | equiv only | dapo only | both -1 | disagree | equiv = verdict "
              "| dapo = verdict |\n|---|---|---|---|---|---|---|---|---|")
        for kind in ("an answer in a box", "a response with a box", "a response without a box", "all"):
            t, n = table[kind], table[kind]["cases"]
            cells = [n, t["both"], t["equiv only"], t["dapo only"], t["neither"],
                     f"{100 * (t['equiv only'] + t['dapo only']) / n:.1f}%",
                     f"{100 * t['equiv right'] / n:.1f}%", f"{100 * t['dapo right'] / n:.1f}%"]
            print(f"| {kind} | " + " | ".join(map(str, cells)) + " |")
        if a.show:
            for (kind, text, case), e, d in zip(rows, equiv, dapo):
                if e != d:
                    print(f"{case['id']} [{kind}] gold {case['gold']!r}: equiv {e:+.0f}, dapo {d:+.0f}: {text[-80:]!r}")


if __name__ == "__main__":
    main()
