"""What the token-level analysis costs: the head's extra reduction, and the per-mini-batch bookkeeping.

    python benchmarks/analysis_overhead.py      # CPU fp32: 8 x 1024 tokens, vocabulary 151,936, hidden 256

The head's forward (head.ChunkedHead) computes, per chunk of 128 tokens, log p and H (what S2T needs) and,
when asked (collision=True, as stapo.py --analysis asks), one more sum, sum pi^2: a square and a sum over the
[chunk, V] fp32 logits. This script times, in one process, (1) the forward without it (the trainer's
default), (2) the forward with it, and (3) the bookkeeping of one mini-batch (analysis.TokenAnalysis.sums:
each token's gradient norms and entropy change, summed into the groups and shares, added up as
metrics.StepMetrics adds them); each the median of 3 after a warm-up. It prints one JSON line of the figures,
then them in words; all of it also goes to a results file (--results: record.py).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # record.py
import analysis  # noqa: E402
import head  # noqa: E402
import metrics  # noqa: E402
import parallel  # noqa: E402
import policy  # noqa: E402
import stapo  # noqa: E402
import record  # noqa: E402


def timed(fn, repeats=3):
    fn()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    record.add_flag(p)
    a = p.parse_args(argv)
    with record.kept(a.results, "analysis_overhead"):
        measure()


def measure():
    torch.manual_seed(0)
    m, d, v = 8 * 1024, 256, 151936
    hidden, weight = torch.randn(m, d), torch.randn(v, d) * d ** -0.5
    tokens = torch.randint(v, (m,))
    without = timed(lambda: head.ChunkedHead.apply(hidden, weight, tokens, 1.0, 128, False))
    full = timed(lambda: head.ChunkedHead.apply(hidden, weight, tokens, 1.0, 128, True))
    parallel.init_distributed()  # S2T's tau_h pools the candidates of all ranks: here one
    rows = (8, 1024)
    out = head.ChunkedHead.apply(hidden, weight, tokens, 1.0, 128, True)
    logp, entropy, collision = (x.view(rows) for x in out)
    adv, valid = torch.randn(8), torch.ones(rows, dtype=torch.bool)
    args = stapo.get_args([])  # the trainer's defaults: --method stapo, tau_p, q, the clips
    s2t = stapo.spurious_tokens(logp, entropy, adv, valid, args.tau_p, args.q)
    keep = (valid & ~s2t.silenced).float()
    view = analysis.TokenAnalysis("stapo", stapo.clip_settings(args), args.tau_p, 1.0)
    now, old_logp = policy.TokenStats(logp, entropy, collision), logp  # ratio 1: before the first update
    book = timed(lambda: metrics.accumulate(dict.fromkeys(analysis.KEYS, 0.0), view.sums(
        now, old_logp, adv, valid, keep, float(keep.sum()), s2t, valid.float())))
    print(json.dumps({"tokens": m, "vocab": v, "hidden": d, "dtype": "float32", "threads": torch.get_num_threads(),
                      "head_forward_s": round(without, 4), "head_forward_with_collision_s": round(full, 4),
                      "collision_over_forward": round(full / without - 1, 4), "bookkeeping_ms": round(book * 1e3, 2)}))
    print(f"{m} tokens, vocabulary {v}, hidden {d}, fp32, {torch.get_num_threads()} threads")
    print(f"head forward: {without:.2f} s; with the analysis's sum pi^2: {full:.2f} s "
          f"(the analysis: +{100 * (full / without - 1):.1f}% of the forward)")
    print(f"the analysis's bookkeeping of the batch: {book * 1000:.1f} ms")
    torch.distributed.destroy_process_group()

if __name__ == "__main__":
    main()
