"""Compiled decoder layers against eager ones, on the trainer's own passes: the ratio of an unchanged policy and
the sync's probe gap, on CPU or a GPU.

    python benchmarks/compiled_layers.py                       # fp32 and bf16: eager, compiled, compiled+emulate
    python benchmarks/compiled_layers.py --dtypes bf16 --rows compiled

The model is the tests' tiny Qwen3 (tests/reference.toy_model, hidden 128, built offline into --work), the HF
engine. Each row builds the policy as stapo.py does (policy.build_policy, --dtype, its layers compiled or not),
syncs the engine (stapo.sync_engine), samples step 0's 8 prompts x 4 (problems.step_prompts, the engine's
generate), and runs step 0's passes through the trainer's public calls, with no optimizer step (an unchanged
policy): the old pass of each of 4 mini-batches (policy.token_stats, no grad, micro-batches of 40 tokens), then
each mini-batch's update forward, micro-batch by micro-batch as stapo.update cuts them (policy.micro_batches;
policy.response_logprobs with grad, and its backward), then the sync again. Rows: eager (the layers uncompiled),
compiled (layers.compile_layers with inductor, as stapo.py --compile-layers on), compiled+emulate (the same with
torch._inductor.config.emulate_precision_casts = True: inductor rounds each op's output to the compute dtype
where eager does). Each row prints one JSON line: the largest |log ratio| over every micro-batch's response
tokens (the update's log p against the old pass's; 0: the two passes computed the same log p, an unchanged
policy's ratio exactly 1), the second sync's probe gap against the HF engine's eager layers (mean and largest
token), the layer calls that ran eager (every call when eager) and whether compiled layers ran eager, and the
row's seconds (its compiles included). A table closes the output; all of it also goes to a results file
(--results: record.py).
"""
import argparse, json, os, sys, tempfile, time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # record.py

PROMPTS, GROUP, MINIBATCHES, MICRO_TOKENS, MAX_PROMPT, MAX_RESPONSE = 8, 4, 4, 40, 64, 8


def unchanged_policy_ratios(P, policy, batch, blocks):
    """The largest |log p (the update's forward, with grad) - log p (the old pass, no grad)| over the response
    tokens of each micro-batch, as stapo.update would see them before its first optimizer step."""
    old = [P.token_stats(policy, batch.rows, idx, batch.valid, MICRO_TOKENS, 1.0).logp for idx in blocks]
    ratios = []
    for idx, old_logp in zip(blocks, old):
        for part, idle in P.micro_batches(batch.rows, idx, MICRO_TOKENS):
            logp = P.response_logprobs(policy, batch.rows, idx[part], batch.valid, 1.0).logp
            logp.sum().backward()  # the training graph's backward, as the update runs it
            if not idle:
                valid = batch.valid[idx[part]]
                ratios.append(float((logp.detach() - old_logp[part])[valid].abs().max()))
        policy.zero_grad(set_to_none=True)
    return ratios


def row(work, dtype, kind):
    """One row's policy, engine and passes: its JSON line."""
    import torch._inductor.config as inductor
    from transformers import AutoTokenizer
    import policy as P, problems, rollout, stapo as S
    from parallel import init_distributed
    inductor.emulate_precision_casts = kind == "compiled+emulate"
    torch._dynamo.reset()
    t0, model = time.perf_counter(), os.path.join(work, "model")
    try:
        rank, world, device, mesh = init_distributed()
        compute = rollout.compute_dtype(dtype, device)
        tok = AutoTokenizer.from_pretrained(model)
        data = problems.encode_problems(tok, problems.load_problems(os.path.join(work, "train.jsonl")), MAX_PROMPT)
        policy = P.build_policy(model, mesh, device, compute, kind != "eager")
        eager_from = policy.layers.eager_calls
        context = MAX_PROMPT + MAX_RESPONSE
        probe = problems.probe_tokens(tok, context - 1)
        engine = rollout.make_engine("hf", model, tok, device, context, 0.3, dtype=compute)
        try:
            S.sync_engine(engine, policy, probe, device)  # as stapo.train does before its first step
            prompts = problems.step_prompts(data, 0, PROMPTS, MINIBATCHES, 0, rank, world)
            seeds = [problems.seed_of(0, 0, g) for g, _, _ in prompts]
            groups = engine.generate([p for _, p, _ in prompts], GROUP, 1.0, 1.0, MAX_RESPONSE, seeds)
            batch = S.make_batch(prompts, groups, torch.zeros(len(prompts) * GROUP), device)
            ratios = unchanged_policy_ratios(P, policy, batch, S.split_minibatches(batch.rows, MINIBATCHES))
            gap_mean, gap_max = S.sync_engine(engine, policy, probe, device)
        finally:
            engine.close()
    finally:
        inductor.emulate_precision_casts = False
    eager = policy.layers.eager_calls - eager_from
    return {"dtype": dtype, "layers": kind, "device": str(device), "micro_batches": len(ratios),
            "max_abs_log_ratio": max(ratios), "probe_gap_mean": gap_mean, "probe_gap_max": gap_max,
            "eager_layer_calls": eager, "ran_eager_although_compiled": bool(policy.layers.compiled and eager),
            "layer_compile_failures": len(policy.layers.failures), "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list: fp32, bf16")
    p.add_argument("--rows", default="eager,compiled,compiled+emulate", help="comma list of the rows above")
    p.add_argument("--work", default="", help="the model's folder (default: a temporary one)")
    import record
    record.add_flag(p)
    a = p.parse_args(argv)
    from reference import toy_model
    work = a.work or tempfile.mkdtemp()
    with record.kept(a.results, "compiled_layers"):
        if not os.path.exists(os.path.join(work, "train.jsonl")):
            toy_model(work, hidden=128)
        lines = []
        for dtype in a.dtypes.split(","):
            for kind in a.rows.split(","):
                lines.append(row(work, dtype, kind))
                print(json.dumps(lines[-1]), flush=True)
        print("\n| dtype | layers | micro-batches | largest abs log ratio, unchanged policy | probe gap, mean "
              "| largest | eager layer calls |\n|---|---|---|---|---|---|---|")
        for x in lines:
            eager = f"**{x['eager_layer_calls']}, although compiled**" if x["ran_eager_although_compiled"] else \
                x["eager_layer_calls"]
            print(f"| {x['dtype']} | {x['layers']} | {x['micro_batches']} | {x['max_abs_log_ratio']:.2e} | "
                  f"{x['probe_gap_mean']:.2e} | {x['probe_gap_max']:.2e} | {eager} |")
    torch.distributed.destroy_process_group()
    return lines


if __name__ == "__main__":
    main()
