"""What the token-level analysis costs: the head's two extra reductions, and the per-mini-batch bookkeeping.

    python benchmarks/analysis_overhead.py      # CPU fp32: 8 x 1024 tokens, vocabulary 151,936, hidden 256

The head's forward (head.ChunkedHead) computes, per chunk of 128 tokens, log p and H (what S2T needs) and
two more sums for the analysis, sum pi^2 and sum pi^2 log pi: a square, a sum and a product-sum over the
[chunk, V] buffer. This script times, in one process, (1) the shipped forward, (2) the same forward with the
analysis's square and second product patched out (their two sums still run, so this understates the cost
a little), and (3) stapo.analyse on the batch (each token's gradient norm and entropy change, summed into
the groups and shares by metrics.StepMetrics.analysis, one process); each the median
of 3 after a warm-up.
"""
import os, statistics, sys, time, types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import head  # noqa: E402
import parallel  # noqa: E402
import metrics  # noqa: E402
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
    square, mul = torch.Tensor.square_, torch.mul
    calls = {"mul": 0}

    def first_product_only(a, b, out=None):  # each chunk's second product is the analysis's
        calls["mul"] += 1
        return mul(a, b, out=out) if calls["mul"] % 2 else out
    torch.Tensor.square_ = lambda self: self
    torch.mul = first_product_only
    try:
        without = timed(lambda: head.ChunkedHead.apply(hidden, weight, tokens, 1.0, 128))
    finally:
        torch.Tensor.square_, torch.mul = square, mul
    parallel.init_distributed()
    logp, stats = head.ChunkedHead.apply(hidden, weight, tokens, 1.0, 128)
    rows = (8, 1024)
    logp, stats = logp.view(rows), stats.view(*rows, 3)
    adv, valid = torch.randn(8), torch.ones(rows, dtype=torch.bool)
    args = stapo.get_args([])
    s2t = stapo.spurious_tokens(logp, stats[..., 0], adv, valid, args)
    batch = types.SimpleNamespace(old_logp=logp, adv=adv, valid=valid)  # ratio 1: w = A
    book = timed(lambda: stapo.analyse(logp, stats, batch, list(range(8)), s2t, args, metrics.StepMetrics(0)))
    print(f"{m} tokens, vocabulary {v}, hidden {d}, fp32, {torch.get_num_threads()} threads")
    print(f"head forward, as shipped: {full:.2f} s; without the analysis's two reductions: {without:.2f} s "
          f"(the analysis: +{100 * (full / without - 1):.1f}% of the forward)")
    print(f"stapo.analyse on the batch: {book * 1000:.1f} ms")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
