"""What the token-level analysis costs: the head's extra reduction, and the per-mini-batch bookkeeping.

    python benchmarks/analysis_overhead.py      # CPU fp32: 8 x 1024 tokens, vocabulary 151,936, hidden 256

The head's forward (head.ChunkedHead) computes, per chunk of 128 tokens, log p and H (what S2T needs) and
one more sum for the analysis, sum pi^2: a square and a sum over the [chunk, V] buffer. This script times,
in one process, (1) the shipped forward, (2) the same forward with the analysis's square patched out (its
sum still runs, so this understates the cost a little), and (3) analysis.analyse on the batch (each token's
gradient norms and entropy change, summed into the groups and shares by analysis.TokenAnalysis, one
process); each the median of 3 after a warm-up.
"""
import os, statistics, sys, time, types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import analysis  # noqa: E402
import head  # noqa: E402
import parallel  # noqa: E402
import stapo  # noqa: E402


def timed(fn, repeats=3):
    fn()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def main():
    torch.manual_seed(0)
    m, d, v = 8 * 1024, 256, 151936
    hidden, weight = torch.randn(m, d), torch.randn(v, d) * d ** -0.5
    tokens = torch.randint(v, (m,))
    full = timed(lambda: head.ChunkedHead.apply(hidden, weight, tokens, 1.0, 128))
    square = torch.Tensor.square_
    torch.Tensor.square_ = lambda self: self
    try:
        without = timed(lambda: head.ChunkedHead.apply(hidden, weight, tokens, 1.0, 128))
    finally:
        torch.Tensor.square_ = square
    parallel.init_distributed()
    logp, stats = head.ChunkedHead.apply(hidden, weight, tokens, 1.0, 128)
    rows = (8, 1024)
    logp, stats = logp.view(rows), stats.view(*rows, 2)
    adv, valid = torch.randn(8), torch.ones(rows, dtype=torch.bool)
    args = stapo.get_args([])
    s2t = stapo.spurious_tokens(logp, stats[..., 0], adv, valid, args.tau_p, args.q)
    batch = types.SimpleNamespace(old_logp=logp, adv=adv, valid=valid)  # ratio 1: w = A
    keep = (valid & ~s2t["silenced"]).float()
    mb = stapo.MiniBatch(list(range(8)), keep, float(keep.sum()))
    sums = lambda: analysis.TokenAnalysis("stapo", stapo.clip_settings(args), args.tau_p, 1.0)  # noqa: E731
    book = timed(lambda: analysis.analyse(sums(), logp, stats, s2t, mb, batch))
    print(f"{m} tokens, vocabulary {v}, hidden {d}, fp32, {torch.get_num_threads()} threads")
    print(f"head forward, as shipped: {full:.2f} s; without the analysis's square: {without:.2f} s "
          f"(the analysis: +{100 * (full / without - 1):.1f}% of the forward)")
    print(f"analysis.analyse on the batch: {book * 1000:.1f} ms")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
