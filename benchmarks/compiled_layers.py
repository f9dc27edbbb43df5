"""Compiled decoder layers against eager ones, in the trainer itself: the ratio of an unchanged policy and the
sync's probe gap, one step of stapo.py at lr 0 per row, on CPU or a GPU.

    python benchmarks/compiled_layers.py                       # fp32 and bf16: eager, compiled, compiled+emulate
    python benchmarks/compiled_layers.py --dtypes bf16 --rows compiled

The model is the tests' tiny Qwen3 (tests/reference.toy_model, hidden 128, built offline into --work), 8
prompts x 4 samples, 4 mini-batches, micro-batches of 40 tokens, the HF engine. Rows: eager (the layers
uncompiled), compiled (layers.compile_layers with inductor, as stapo.py --compile-layers on), compiled+emulate
(the same with torch._inductor.config.emulate_precision_casts = True: inductor rounds each op's output to the
compute dtype where eager does). Each row prints the largest |log ratio| over every micro-batch's kept tokens
(0: the old pass and the update computed the same log p, an unchanged policy's ratio exactly 1), the sync's
probe gap against the HF engine's eager layers (mean and largest token), the layer calls that ran eager, and
the row's seconds (its compiles included).
"""
import argparse, json, os, sys, tempfile, time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def row(work, dtype, kind):
    """One step at lr 0 of the row's trainer: its JSON line."""
    import torch._inductor.config as inductor
    import stapo
    import stapo_core
    from reference import flags
    ratios, real_loss = [], stapo_core.stapo_loss  # the trainer's loss, spied on under the trainer's name

    def recording(logp, old_logp, adv, keep, *a, **k):
        ratios.append((logp.detach().float() - old_logp.float())[keep > 0].abs().max())
        return real_loss(logp, old_logp, adv, keep, *a, **k)
    stapo.stapo_loss = recording
    inductor.emulate_precision_casts = kind == "compiled+emulate"
    torch._dynamo.reset()
    out, t0 = os.path.join(work, f"{dtype}_{kind}"), time.perf_counter()
    argv = flags(work, out, 1) + ["--lr", "0", "--prompts-per-step", "8", "--group-size", "4", "--minibatches",
                                  "4", "--micro-tokens", "40", "--dtype", dtype, "--engine", "hf",
                                  "--compile-layers", "off" if kind == "eager" else "on"]
    try:
        stapo.train(stapo.get_args(argv))
    finally:
        stapo.stapo_loss, inductor.emulate_precision_casts = real_loss, False
    m = json.loads(open(os.path.join(out, "metrics.jsonl")).readline())
    device = json.load(open(os.path.join(out, "config.json")))["device"]
    return {"dtype": dtype, "layers": kind, "device": device,
            "micro_batches": len(ratios), "max_abs_log_ratio": float(torch.stack(ratios).max()),
            "probe_gap_mean": m["sync_probe_gap_mean"], "probe_gap_max": m["sync_probe_gap"],
            "eager_layer_calls": m.get("eager_layer_calls"), "seconds": round(time.perf_counter() - t0, 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list: fp32, bf16")
    p.add_argument("--rows", default="eager,compiled,compiled+emulate", help="comma list of the rows above")
    p.add_argument("--work", default="", help="the model's folder (default: a temporary one)")
    a = p.parse_args()
    from reference import toy_model
    work = a.work or tempfile.mkdtemp()
    if not os.path.exists(os.path.join(work, "train.jsonl")):
        toy_model(work, hidden=128)
    lines = []
    for dtype in a.dtypes.split(","):
        for kind in a.rows.split(","):
            lines.append(row(work, dtype, kind))
            print(json.dumps(lines[-1]), flush=True)
    print("\n| dtype | layers | micro-batches | largest abs log ratio at lr 0 | probe gap, mean | largest |")
    print("|---|---|---|---|---|---|")
    for x in lines:
        print(f"| {x['dtype']} | {x['layers']} | {x['micro_batches']} | {x['max_abs_log_ratio']:.2e} | "
              f"{x['probe_gap_mean']:.2e} | {x['probe_gap_max']:.2e} |")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
