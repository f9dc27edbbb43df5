"""The sync's two checks, measured: the probe's log-prob gaps and the weight digest, for a good sync and broken ones.

    python benchmarks/sync_gaps.py            # vLLM's CPU build; about 10 minutes on 2 shared cores

After each sync, stapo.sync_engine proves it twice. rollout.push_weights compares a digest of the weights the engine
computes with against one of the tensors pushed (exact, per decoder layer, embedding, final norm and LM head); then
the engine's log-probs of a fixed probe (problems.PROBE, a prompt and a worked answer, cut to the context) are
compared with the trainer's forward, within stapo.SYNC_TOLERANCE (mean and largest |gap|). This script measures,
per token of the probe, |engine - trainer|, and the digest's verdict, for:
  good        the trainer's weights pushed as stapo.py pushes them, after 0, 1, 2, 3 optimizer steps
  stale step  one more optimizer step, and nothing reached the engine
  stale 2%    the trainer moved by seeded noise (2% of each weight's scale), nothing pushed
  partial     the push stops before the final norm and the lm_head
  tied        the lm_head not sent under its own name (a tied model: vLLM's CPU build keeps its packed copy)
  dummy       no push at all: vLLM's dummy weights
An optimizer step is the trainer's: AdamW (policy.build_optimizer) at the paper's lr 1e-6, weight decay 0.1, on
the gradient of a real loss (the negative log-likelihood of 16 toy answers, clipped at norm 1). It also prints what
that step moves: the share of the weights whose value in the engine's dtype changed, and the trainer's own probe
log-probs before and after it (|after - before|, the gap a stale engine would show with no noise at all).
On the toy's warm-started Qwen3 (hidden 128, 2 layers, V 300; untied and tied), one trainer process (FSDP2 over one
rank, bf16 or fp32 compute) and one colocated engine in the same dtype, as in training; and the digest's cost.
"""
import json, os, sys, tempfile, time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
LR, WEIGHT_DECAY = 1e-6, 0.1


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


def answers(tok, k):
    """Batch k of 16 toy problems with their answers: (rows, valid) as policy.response_logprobs takes them."""
    import toy
    from problems import encode_prompt
    rows = [(encode_prompt(tok, r["problem"]), tok.encode(toy.target(r, False) + "<|im_end|>",
                                                          add_special_tokens=False))
            for r in toy.problems()[0][16 * k:16 * (k + 1)]]
    valid = torch.zeros(len(rows), max(len(a) for _, a in rows), dtype=torch.bool)
    for i, (_, a) in enumerate(rows):
        valid[i, :len(a)] = True
    return rows, valid


def optimizer_step(policy, opt, batch):
    """One AdamW step on the negative log-likelihood of the batch's answers, the gradient clipped at 1."""
    from policy import response_logprobs
    rows, valid = batch
    logp = response_logprobs(policy, rows, list(range(len(rows))), valid, 1.0).logp
    (-(logp * valid).sum() / valid.sum()).backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def trainer_logprobs(policy, probe):
    from policy import response_logprobs
    rows, valid = [(probe[:1], probe[1:])], torch.ones(1, len(probe) - 1, dtype=torch.bool)
    with torch.no_grad():
        want = response_logprobs(policy, rows, [0], valid, 1.0).logp[0]
    policy.reshard()
    return want


def sync(engine, policy, probe, push=None):
    """rollout.push_weights through `push` in place of engine.load_weights (None: the real one): the probe's
    per-token |gap|, and the digest's verdict (the error's first line, or None: the sync proved exact)."""
    import rollout
    if push is not None:
        engine.load_weights = push
    try:
        rollout.push_weights(engine, policy.lm)
        verdict = None
    except RuntimeError as e:
        verdict = str(e)
    finally:
        if push is not None:
            del engine.load_weights
    return (torch.tensor(engine.logprobs_of(probe)) - trainer_logprobs(policy, probe)).abs(), verdict


def pushed_values(policy, dtype):
    import rollout
    return {n: t.clone() for n, t in rollout.full_params(policy.lm, dtype)}


def digest_cost(engine, policy, dtype, repeats=5):
    """Seconds per digest, the fastest of `repeats` (the machine is shared): the trainer's (from the tensors
    full_params yields, their all-gather left out), the engine's (weight_digest) and load_weights' own, on the
    toy; the values digested; and ns a value on one tensor of 2^26 values, where per-tensor overheads vanish."""
    import rollout
    named = list(pushed_values(policy, dtype).items())
    big = [("lm_head.weight", torch.randn(1 << 26).to(dtype))]
    seconds = {}
    for what, run in (("trainer_s", lambda: rollout.digest_of(named, dtype)), ("engine_s", engine.weight_digest),
                      ("load_weights_s", lambda: engine.load_weights(iter(named))),
                      ("big_s", lambda: rollout.digest_of(big, dtype))):
        times = []
        for _ in range(repeats if what != "big_s" else 2):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        seconds[what] = min(times)
    return {"values": sum(t.numel() for _, t in named), **seconds, "big_ns": seconds["big_s"] / (1 << 26) * 1e9}


def main(dtype_name, tied, out):
    import parallel
    import problems
    from policy import build_optimizer, build_policy
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
    opt = build_optimizer(policy, LR, WEIGHT_DECAY)
    engine = VLLMEngine(folder, context, 0.5, for_training=True, dtype=dtype)
    real, rows = engine.load_weights, {}
    gathered = lambda named: [None for _ in named]  # noqa: E731  (gathered, and never sent)
    rows["dummy"] = sync(engine, policy, probe, gathered)
    rows["partial"] = sync(engine, policy, probe, lambda named: real(list(named)[:-2]))
    if tied:
        unsent_head = lambda named: real((n, t) for n, t in named if n != "lm_head.weight")  # noqa: E731
        rows["tied"] = sync(engine, policy, probe, unsent_head)
    good = [sync(engine, policy, probe)]
    for k in range(3):
        optimizer_step(policy, opt, answers(tok, k))
        good.append(sync(engine, policy, probe))
    rows["good"] = torch.cat([g for g, _ in good]), next((v for _, v in good if v), None)
    before, probe_before = pushed_values(policy, dtype), trainer_logprobs(policy, probe)
    optimizer_step(policy, opt, answers(tok, 3))
    after, probe_after = pushed_values(policy, dtype), trainer_logprobs(policy, probe)
    changed = sum(int((before[n] != after[n]).sum()) for n in before)
    step = {"changed": changed, "values": sum(t.numel() for t in before.values()),
            "probe_moved_mean": float((probe_after - probe_before).abs().mean()),
            "probe_moved_max": float((probe_after - probe_before).abs().max())}
    rows["stale step"] = sync(engine, policy, probe, gathered)
    sync(engine, policy, probe)
    moved(policy, 4)
    rows["stale 2%"] = sync(engine, policy, probe, gathered)
    sync(engine, policy, probe)
    summary = {k: {"tokens": len(v), "mean": v.mean().item(), "p50": v.median().item(), "p95": v.quantile(0.95).item(),
                   "max": v.max().item(), "digest": verdict} for k, (v, verdict) in rows.items()}
    json.dump({"rows": summary, "step": step, "cost": digest_cost(engine, policy, dtype)}, open(out, "w"))
    engine.close()  # vLLM's shutdown (it destroys the process group)


def measure_all():
    """Each dtype and model in a child process of its own (one engine each): the table, the step, the cost."""
    import subprocess
    import stapo
    print("| dtype | model | sync | tokens | mean | median | p95 | max | probe check | digest check |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    steps, costs = {}, {}
    for dtype in ("bf16", "fp32"):
        tolerance = stapo.SYNC_TOLERANCE[{"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]]
        for kind in ("untied", "tied"):
            out = tempfile.mktemp(suffix=".json")
            subprocess.run([sys.executable, __file__, dtype, kind, out], check=True, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            result = json.load(open(out))
            for case, s in result["rows"].items():
                ok = s["mean"] <= tolerance[0] and s["max"] <= tolerance[1]
                print(f"| {dtype} | {kind} | {case} | {s['tokens']} | {s['mean']:.2e} | {s['p50']:.2e} | "
                      f"{s['p95']:.2e} | {s['max']:.2e} | {'passes' if ok else 'fails'} | "
                      f"{'passes' if s['digest'] is None else 'fails'} |", flush=True)
            steps[dtype, kind], costs[dtype, kind] = result["step"], result["cost"]
    print("tolerances (mean, max):", {str(k)[6:]: v for k, v in stapo.SYNC_TOLERANCE.items()})
    print(f"\nOne optimizer step (AdamW, lr {LR}): the weights' values it changed in the engine's dtype, and the "
          "trainer's probe log-probs it moved (|after - before|)")
    for (dtype, kind), s in steps.items():
        print(f"  {dtype} {kind}: {s['changed']:,} of {s['values']:,} values ({s['changed'] / s['values']:.2%}); "
              f"probe moved mean {s['probe_moved_mean']:.2e}, max {s['probe_moved_max']:.2e}")
    print("\nThe digest's cost, seconds per sync on the toy (the fastest of 5), beside load_weights' own; and on "
          "one tensor of 2^26 values")
    for (dtype, kind), c in costs.items():
        print(f"  {dtype} {kind}: {c['values']:,} values; trainer {c['trainer_s']:.4f} s, engine "
              f"{c['engine_s']:.4f} s, load_weights {c['load_weights_s']:.4f} s; 2^26 values {c['big_s']:.2f} s "
              f"({c['big_ns']:.1f} ns a value)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("bf16", "fp32"):  # a child: one engine per process
        try:
            main(sys.argv[1], sys.argv[2] == "tied", sys.argv[3])
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        sys.exit()
    import argparse
    import record
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    record.add_flag(parser)
    with record.kept(parser.parse_args().results, "sync_gaps"):
        measure_all()
