"""The checker on the public graders' own test cases, side by side with Math-Verify when present.

    python benchmarks/public_graders.py [--show-misses]

tests/data/public_grader_cases.jsonl holds the answer-level cases of public graders' test suites
(Math-Verify's tests/, lighteval's extractive-match tests, the MATH grader's, NeMo-Skills', a Qwen2.5-Math
grader's, and lm-evaluation-harness's Minerva examples), one JSON object a line: its source
(repository@commit path::test), its class, the gold and the prediction, the source's verdict, and the
verdict we hold right (`verdict`), which differs from the source's only where a `reason` says why.

stapo: is_equivalent(pred, gold), where a prediction marked "text" (a whole response) first goes through
extract_answer, and a gold marked "text" (a whole solution) goes in as it is: is_equivalent reads its final
answer. Math-Verify (install math-verify in a separate environment: never a dependency of this project)
runs each case the way its source runs it: Math-Verify's own cases with their test's extraction targets,
precision and flags (its tests' `compare_strings`); the other graders' answer-level cases as
verify(parse("$gold$"), parse("\\boxed{pred}")), as benchmarks/reward.py does; a response as parse(text).
Prints agreement with `verdict` per class, agreement with the sources' own verdicts, cases per second
for both, and the cases each checker gets wrong.
"""
import argparse, collections, json, os, sys, time
from importlib.metadata import version

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # record.py
from reward import extract_answer, is_equivalent  # noqa: E402

CASES = os.path.join(HERE, "tests", "data", "public_grader_cases.jsonl")
CLASSES = ["inequalities", "equations", "matrices", "lists", "final-answer formats",  # the five first reported
           "numbers", "intervals", "named answers", "expressions", "text"]


def load(path=CASES):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def stapo(case):
    """Our verdict on one case: a response goes through extract_answer, an answer or a gold straight on."""
    pred = extract_answer(case["pred"]) if case["pred_kind"] == "text" else case["pred"]
    return pred is not None and is_equivalent(pred, case["gold"])


def math_verify_checker():
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError:
        return None

    def check(case):
        how, gold, pred = case["math_verify"], case["gold"], case["pred"]
        try:
            if how.get("wrap"):  # another grader's answer-level case
                return bool(verify(parse("$%s$" % gold), parse("\\boxed{%s}" % pred)))
            if how.get("text"):  # a response against a bare gold
                return bool(verify(parse("$%s$" % gold), parse(pred)))
            if how.get("default"):  # the test calls parse and verify with their defaults
                return bool(verify(parse(gold), parse(pred)))
            # Math-Verify's own case: its tests' compare_strings, with that test's targets and flags
            targets = [LatexExtractionConfig(boxed_match_priority=0) if t == "latex" else ExprExtractionConfig()
                       for t in how["match_types"]]
            flags = dict(float_rounding=how["precision"], strict=how["strict"],
                         allow_set_relation_comp=how["set_rel"])
            return bool(verify(parse(gold, targets), parse(pred, targets), **flags))
        except Exception:
            return False
    return check


def timed(check, cases):
    t0 = time.perf_counter()
    verdicts = [check(c) for c in cases]
    return verdicts, len(cases) / (time.perf_counter() - t0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--show-misses", action="store_true", help="print every case a checker gets wrong")
    import record
    record.add_flag(p)
    a = p.parse_args()
    with record.kept(a.results, "public_graders"):
        cases = load()
        checkers = {"stapo": stapo}
        mv = math_verify_checker()
        if mv:
            checkers["Math-Verify"] = mv
        is_equivalent("x+1", "x+1.5")  # start the sympy worker outside the timing
        results = {name: timed(check, cases) for name, check in checkers.items()}
        sources = collections.Counter(c["source"].split("@")[0] for c in cases)
        print(f"{len(cases)} cases from " + ", ".join(f"{s} ({n})" for s, n in sources.most_common()))
        print("stapo: extract_answer on a response, then is_equivalent(pred, gold), timeout 5 s, REL_TOL 1e-4"
              + (f"; Math-Verify {version('math-verify')}: each case as its source runs it (see the docstring)"
                 if mv else "") + "; one process, one checker after the other\n")
        print("| class | cases | " + " | ".join(f"{n} agrees" for n in results) + " |")
        print("|---|---|" + "---|" * len(results))
        for cls in CLASSES:
            idx = [i for i, c in enumerate(cases) if c["class"] == cls]
            cells = [f"{sum(v[i] == bool(cases[i]['verdict']) for i in idx)}" for v, _ in results.values()]
            print(f"| {cls} | {len(idx)} | " + " | ".join(cells) + " |")
        for label, key in (("**all**", "verdict"), ("all, against the sources' own verdicts", "source_verdict")):
            agree = [sum(v[i] == bool(c[key]) for i, c in enumerate(cases)) for v, _ in results.values()]
            cells = [f"{n} ({100 * n / len(cases):.1f}%)" for n in agree]
            print(f"| {label} | {len(cases)} | " + " | ".join(cells) + " |")
        print("\n| checker | cases/s |\n|---|---|")
        for name, (_, speed) in results.items():
            print(f"| {name} | {speed:,.0f} |")
        differ = [c for c in cases if c["verdict"] != c["source_verdict"]]
        print(f"\n{len(differ)} cases where our verdict differs from the source's, deliberately:")
        for c in differ:
            print(f"    #{c['id']} [{c['class']}] {c['source'].split(' ')[0]}: {c['reason']}")
        for name, (v, _) in results.items():
            wrong = [c for i, c in enumerate(cases) if v[i] != bool(c["verdict"])]
            print(f"\n{name}: {len(wrong)} cases judged against `verdict`")
            for c in wrong if a.show_misses else []:
                short = [s if len(s) < 100 else s[:45] + " ... " + s[-45:] for s in (c["gold"], c["pred"])]
                print(f"    #{c['id']} [{c['class']}] verdict={c['verdict']} gold={short[0]!r} pred={short[1]!r}")


if __name__ == "__main__":
    main()
