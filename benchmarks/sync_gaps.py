"""The sync's self-check, measured: probe gaps of a good sync and of broken ones, in bf16 and fp32.

    python benchmarks/sync_gaps.py            # vLLM's CPU build; about 3 minutes on 2 cores

After each sync, stapo.sync_engine compares the engine's log-probs of a fixed probe (problems.PROBE, a prompt
and a worked answer, cut to the context) with the trainer's forward, and raises when the mean or the largest
|gap| passes stapo.SYNC_TOLERANCE. This script measures, per token of the probe, |engine - trainer| for:
  good      the trainer's weights pushed as stapo.py does (after 0, 1, 2, 3 seeded moves of the weights)
  stale     the trainer moved (seeded noise, 2% of each weight's scale) and nothing reached the engine
  partial   the push stops before the final norm and the lm_head
  dummy     no push at all: vLLM's dummy weights
  tied      a tied model whose lm_head is not sent under its own name
on the toy's warm-started Qwen3 (hidden 128, 2 layers, V 300; untied and tied), one trainer process (FSDP2
over one rank, bf16 or fp32 compute) and one colocated engine in the same dtype, as in training.
Each row prints the per-token |gap| distribution: mean, median, 95th percentile, max, over the probe.
"""
import json, os, sys, tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def build(folder, tied):
    import toy
    tok = toy.build_tokenizer(folder)
    model = toy.build_model(folder, tok, hidden=128, tied=tied)
    toy.warm_start(model, tok, toy.problems()[0], steps=120).save_pretrained(folder)
    return tok


def moved(policy, seed):
    """Seeded noise on every weight, 2% of its own scale: the trainer after some steps."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(0.02 * local.float().std().nan_to_num(1.0) * torch.randn(local.shape, generator=g))


def gaps(engine, policy, probe, device, push):
    import rollout
    from policy import response_logprobs
    push(rollout.full_params(policy.lm, engine.dtype))
    rows, valid = [(probe[:1], probe[1:])], torch.ones(1, len(probe) - 1, dtype=torch.bool)
    with torch.no_grad():
        want = response_logprobs(policy, rows, [0], valid, 1.0).logp[0]
    return (torch.tensor(engine.logprobs_of(probe)) - want).abs()


def main(dtype_name, tied, out):
    import parallel
    import problems
    from policy import build_policy
    from problems import encode_prompt
    from rollout import VLLMEngine
    folder = tempfile.mkdtemp()
    tok = build(folder, tied)
    rank, world, device, mesh = parallel.init_distributed()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    context = 256
    probe = encode_prompt(tok, problems.PROBE[0]) + tok.encode(problems.PROBE[1], add_special_tokens=False)
    probe = probe[:context - 1]
    policy = build_policy(folder, mesh, device, dtype)
    engine = VLLMEngine(folder, context, 0.5, for_training=True, dtype=dtype)
    real, rows = engine.load_weights, {}
    rows["dummy"] = gaps(engine, policy, probe, device, lambda named: [None for _ in named])
    if tied:
        untied_push = lambda named: real((n, t) for n, t in named if n != "lm_head.weight")  # noqa: E731
        rows["tied"] = gaps(engine, policy, probe, device, untied_push)
    else:
        rows["partial"] = gaps(engine, policy, probe, device, lambda named: real(list(named)[:-2]))
    good = [gaps(engine, policy, probe, device, real)]
    for seed in (1, 2, 3):
        moved(policy, seed)
        good.append(gaps(engine, policy, probe, device, real))
    rows["good"] = torch.cat(good)
    moved(policy, 4)
    rows["stale"] = gaps(engine, policy, probe, device, lambda named: [None for _ in named])
    summary = {k: {"tokens": len(v), "mean": v.mean().item(), "p50": v.median().item(),
                   "p95": v.quantile(0.95).item(), "max": v.max().item()} for k, v in rows.items()}
    json.dump(summary, open(out, "w"))


if __name__ == "__main__":
    if len(sys.argv) > 1:  # a child: one engine per process (vLLM's CPU worker rebinds the process)
        try:
            main(sys.argv[1], sys.argv[2] == "tied", sys.argv[3])
        finally:
            torch.distributed.destroy_process_group()
        sys.exit()
    import subprocess
    import stapo
    print("| dtype | model | sync | tokens | mean | median | p95 | max | passes the self-check |")
    print("|---|---|---|---|---|---|---|---|---|")
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    for dtype in ("bf16", "fp32"):
        tolerance = stapo.SYNC_TOLERANCE[{"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]]
        for kind in ("untied", "tied"):
            out = tempfile.mktemp(suffix=".json")
            subprocess.run([sys.executable, __file__, dtype, kind, out], check=True, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for case, s in json.load(open(out)).items():
                ok = s["mean"] <= tolerance[0] and s["max"] <= tolerance[1]
                print(f"| {dtype} | {kind} | {case} | {s['tokens']} | {s['mean']:.2e} | {s['p50']:.2e} | "
                      f"{s['p95']:.2e} | {s['max']:.2e} | {'yes' if ok else 'no'} |", flush=True)
    print("tolerances (mean, max):", {str(k)[6:]: v for k, v in stapo.SYNC_TOLERANCE.items()})
