"""Naive vs chunked token log-probs + entropy: time and peak memory of forward+backward, in one run.

    python benchmarks/logprobs.py                    # CPU: fp32, 4 x 1024 tokens, vocab 151,936, hidden 1024
    python benchmarks/logprobs.py --hidden 4096      # GPU (auto-detected): bf16, Qwen3-8B's hidden size
    python benchmarks/logprobs.py --batch 8 --seq 2048 --hidden 2048 --variants naive,chunked,eager,chunk128
    python benchmarks/logprobs.py --batch 8 --seq 2048 --hidden 2048 --variants naive,chunked,trl

The chunked head runs as the trainer runs it: rows per chunk chosen by the head for the device and vocabulary
(head.chunk_rows; --chunk N to force), its per-chunk math compiled on CUDA (head.compiles). Rows
(--variants): naive; chunked (the head's defaults); eager (the head with STAPO_HEAD_COMPILE=0: its per-chunk
math uncompiled, as on a CPU); chunk128 (the head at 128 rows, compiled where the head compiles); trl (TRL
1.16's fused LM head, trl.kernels.ChunkedLogProbFunction, as its GRPOTrainer calls it: tiles of 4,096 tokens by 32,768
vocabulary entries, a Triton kernel on CUDA and torch ops elsewhere, log p and the entropy; it needs only the
trl package, none of TRL's other dependencies). The timed pass follows one warm-up pass, which also compiles.

Each method runs in its own child process, so one cannot hide the other's peak; its JSON line prints as it
ends ({"variant": ..., "seconds": ..., "peak_gb": ...}), and one that fails gets a JSON line and a row saying why
({"variant": ..., "error": ...}). The ratios below the table are of this one run (each variant's one timed pass).
All of it also goes to a results file (--results: record.py). On CPU the peak is the resident set's high-water mark
(VmHWM, reset before the timed pass); on GPU, max_memory_allocated. Memory is reported above what the
inputs (hidden states, lm_head weight, tokens) already hold.
"""
import argparse, json, os, subprocess, sys, time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # record.py
import head  # noqa: E402
from head import token_logprobs_and_entropy  # noqa: E402


VARIANTS = ["naive", "chunked", "eager", "chunk128", "trl"]
TRL_VOCAB_CHUNK = 32768  # TRL 1.16's GRPOTrainer: trl/trainer/utils.py, _CHUNKED_LOGPROB_CHUNK_SIZE


def trl_head(hidden, weight, tokens, temperature):
    """TRL 1.16's fused LM head, as its GRPOTrainer calls it (no bias, no softcapping): log p and H."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    logp, entropy, *_ = ChunkedLogProbFunction.apply(hidden, weight, None, tokens, temperature,
                                                     TRL_VOCAB_CHUNK, None, 1.0, ("entropy",))
    return logp, entropy


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
    chunk = 128 if a.method == "chunk128" else a.chunk  # None: the head's choice
    ours = a.method not in ("naive", "trl")  # the project's head, in one of its settings
    fn = {"naive": naive, "trl": trl_head}.get(a.method) or (
        lambda *x: token_logprobs_and_entropy(*x, chunk_size=chunk))
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
                      "dtype": str(dtype).replace("torch.", ""),
                      "chunk": (chunk or head.chunk_rows(dev, a.vocab)) if ours else "-",
                      "compiled": head.compiles(dev) and ours,
                      "name": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4, help="sequences")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen3's)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size")
    p.add_argument("--chunk", type=int, help="the chunked head's rows per chunk (default: the head's choice)")
    p.add_argument("--variants", default="naive,chunked", help="rows: naive, chunked, eager, chunk128, trl")
    p.add_argument("--method", choices=VARIANTS, help=argparse.SUPPRESS)
    import record
    record.add_flag(p)
    a = p.parse_args(argv)
    if a.method:
        return run_one(a)
    with record.kept(a.results, "logprobs"):
        res, failed = {}, {}
        for method in a.variants.split(","):
            env = {**os.environ, **({"STAPO_HEAD_COMPILE": "0"} if method == "eager" else {})}
            argv_child = list(sys.argv[1:] if argv is None else argv) + ["--method", method, "--results", "none"]
            r = subprocess.run([sys.executable, __file__, *argv_child], capture_output=True, text=True, env=env)
            if r.returncode:  # its row says why (an OOM, TRL's kernel on this device); the other rows still print
                failed[method] = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1][:200]
                print(json.dumps({"variant": method, "error": failed[method]}), flush=True)
                continue
            res[method] = json.loads(r.stdout.strip().splitlines()[-1])
            print(json.dumps({"variant": method, **res[method]}), flush=True)  # kept if a time cap cuts the rest
        if not res:
            sys.exit("logprobs.py: every variant failed")
        print_table(a, res, failed)


def ratio(x, y, digits):
    """x / y as "1.23x", or "n/a" where y is 0: at a tiny shape a pass can fit in memory the process already
    holds, so its measured peak above the inputs is 0."""
    return f"{x / y:.{digits}f}x" if y else "n/a"


def print_table(a, res, failed):
    variants = list(res)
    first = res[variants[0]]
    print(f"{a.batch} x {a.seq} tokens, vocab {a.vocab}, hidden {a.hidden}, {first['name']} "
          f"{first['dtype']}, forward+backward")
    print("| method | rows per chunk | compiled | time (s) | peak memory above inputs (GiB) |")
    print("|---|---|---|---|---|")
    for k in variants:
        rows = res[k]["chunk"]
        compiled = "-" if rows == "-" else res[k]["compiled"]  # not the project's head
        print(f"| {k} | {rows} | {compiled} | {res[k]['seconds']:.3f} | {res[k]['peak_gb']:.2f} |")
    for k, why in failed.items():
        print(f"| {k} | failed: {why} | | | |")
    if "naive" in res:
        n = res["naive"]
        for k in [v for v in variants if v != "naive"]:
            c = res[k]
            print(f"{k}/naive: time {ratio(c['seconds'], n['seconds'], 2)}, "
                  f"memory {ratio(c['peak_gb'], n['peak_gb'], 3)} (chunk {c['chunk']})")
    if "chunked" in res and "trl" in res:
        c, t = res["chunked"], res["trl"]
        print(f"chunked/trl: time {ratio(c['seconds'], t['seconds'], 2)}, "
              f"memory {ratio(c['peak_gb'], t['peak_gb'], 3)}")


if __name__ == "__main__":
    main()
