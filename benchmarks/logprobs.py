"""Naive vs chunked token log-probs + entropy: time and peak memory of forward+backward, in one run.

    python benchmarks/logprobs.py                    # CPU: fp32, 4 x 1024 tokens, vocab 151,936, hidden 1024
    python benchmarks/logprobs.py --hidden 4096      # GPU (auto-detected): bf16, Qwen3-8B's hidden size

Each method runs in its own child process, so one cannot hide the other's peak. On CPU the peak is the
resident set's high-water mark (VmHWM, reset before the timed pass); on GPU, max_memory_allocated. Memory is reported above what the
inputs (hidden states, lm_head weight, tokens) already hold.
"""
import argparse, json, os, subprocess, sys, time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from head import token_logprobs_and_entropy  # noqa: E402


def naive(hidden, weight, tokens, temperature):
    logp_all = torch.log_softmax((hidden @ weight.T).float() / temperature, -1)
    logp = logp_all.gather(-1, tokens[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1).detach()
    return logp, entropy


def rss_bytes(field):  # Linux: VmRSS now, or VmHWM, the peak since the last reset_peak()
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))


def reset_peak(dev):
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    return rss_bytes("VmRSS")


def peak_bytes(dev):
    return torch.cuda.max_memory_allocated() if dev == "cuda" else rss_bytes("VmHWM")


def run_one(a):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    torch.manual_seed(0)
    m = a.batch * a.seq
    hidden = torch.randn(m, a.hidden, device=dev, dtype=dtype, requires_grad=True)
    weight = (torch.randn(a.vocab, a.hidden, device=dev, dtype=dtype) * a.hidden ** -0.5).requires_grad_()
    tokens = torch.randint(a.vocab, (m,), device=dev)
    coef = torch.randn(m, device=dev)
    fn = naive if a.method == "naive" else (
        lambda *x: token_logprobs_and_entropy(*x, chunk_size=a.chunk))
    for it in range(2):  # the first pass warms up; the second is timed and its peak measured
        hidden.grad = weight.grad = None
        base = reset_peak(dev)
        t0 = time.perf_counter()
        logp, ent = fn(hidden, weight, tokens, 0.7)
        (logp * coef).sum().backward()
        if dev == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "peak_gb": (peak_bytes(dev) - base) / 2**30, "device": dev,
                      "dtype": str(dtype).replace("torch.", "")}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4, help="sequences")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen3's)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size")
    p.add_argument("--chunk", type=int, default=128, help="the chunked head's rows per chunk")
    p.add_argument("--method", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.method:
        return run_one(a)
    res = {}
    for method in ("naive", "chunked"):
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--method", method],
                             check=True, capture_output=True, text=True).stdout
        res[method] = json.loads(out.strip().splitlines()[-1])
    n, c = res["naive"], res["chunked"]
    print(f"{a.batch} x {a.seq} tokens, vocab {a.vocab}, hidden {a.hidden}, chunk {a.chunk}, "
          f"{n['device']} {n['dtype']}, forward+backward")
    print("| method  | time (s) | peak memory above inputs (GiB) |\n|---|---|---|")
    for k in ("naive", "chunked"):
        print(f"| {k:7} | {res[k]['seconds']:.3f} | {res[k]['peak_gb']:.2f} |")
    print(f"chunked/naive: time {c['seconds'] / n['seconds']:.2f}x, memory {c['peak_gb'] / n['peak_gb']:.3f}x")


if __name__ == "__main__":
    main()
