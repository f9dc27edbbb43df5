"""stapo vs TRL's GRPOTrainer on this CPU: seconds per step and peak resident memory, side by side.

    python benchmarks/vs_trl.py --config a --pairs 3                 # TRL from this python
    python benchmarks/vs_trl.py --config b --pairs 3 --steps 4 --trl-python /other/venv/bin/python
    python benchmarks/vs_trl.py --config b --steps 10 --only stapo  # one side: its per-step peaks, no pairs

TRL runs from the python given (requirements-dev.txt installs trl==1.16.0 in the test venv; the four
modules never import it). Both sides get the same tiny Qwen3 folder (built here, offline), the same
prompts, the same reward (reward.score_all), 2 threads, G=8, one optimizer step per generation batch, and
completions of exactly T tokens sampled from the full vocabulary (the end-of-text id lies outside the
model's). Precision and activation checkpointing are set on both sides, never left to defaults: fp32
weights and compute (TRL 1.16 defaults to bf16=True, autocast, even on CPU: set bf16=False here), and
full activation checkpointing on both (stapo: --checkpointing full, its default; TRL's gradient_checkpointing
defaults to True and is set so; --trl-checkpointing off measures TRL without it).

    (a) vocab 512, hidden 64, 4 prompts x 8, T=128        (b) vocab 151,936, hidden 256, 2 prompts x 8, T=512

Each run is its own child process, TRL and stapo interleaved (a pair = one of each), so a noisy spell
of the machine hits both sides of a pair. A run's time is the median of its steps after the first
(warm-up). Memory is each step's peak resident set (VmHWM, reset after every step on both sides; stapo's
trainer records it by phase); a run's peak is the largest.
The speed ratio is TRL's step over stapo's, taken within each pair; the figure is the median of those per-pair
ratios (for an even count the lower of the middle two: one pair's own ratio), and the table's step columns are
that median pair's steps, so TRL step / stapo step is the ratio printed beside them. The memory ratio is stapo's
largest peak over TRL's, each over all its runs. Each pair prints a JSON line, and the summary one (every pair's
ratio with it); all of it also goes to a results file (--results: record.py).
"""
import argparse, json, os, shutil, statistics, subprocess, sys, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # record.py
CONFIGS = {"a": dict(vocab=512, hidden=64, prompts=4, tokens=128),
           "b": dict(vocab=151936, hidden=256, prompts=2, tokens=512)}
G = 8


def build(folder, vocab, hidden, prompts, tokens):
    """A word-level tokenizer over the model's vocabulary (every sampled id decodes) plus an end-of-text
    token just past it, which the model can never sample: every completion runs to exactly `tokens`. A
    2-layer Qwen3, and `prompts` problems of 16 words each, written to folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    words = ["<pad>"] + [f"w{i}" for i in range(vocab - 1)] + ["<eos>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                      max_position_embeddings=tokens + 64, tie_word_embeddings=False, eos_token_id=vocab,
                      pad_token_id=0, bos_token_id=None)
    Qwen3ForCausalLM(cfg).save_pretrained(folder)
    with open(os.path.join(folder, "data.jsonl"), "w") as f:
        for k in range(prompts):
            problem = " ".join(f"w{(k * 16 + i) % (vocab - 1)}" for i in range(16))
            f.write(json.dumps({"problem": problem, "answer": str(k)}) + "\n")


def run_stapo(folder, c, steps):
    """stapo.train itself, as a user runs it; the step time is the trainer's own step_s."""
    import torch.distributed as dist
    import stapo
    out = os.path.join(folder, "stapo_run")
    shutil.rmtree(out, ignore_errors=True)  # each run starts fresh: stapo refuses an --out that holds a run
    args = stapo.get_args(["--model", folder, "--dataset", os.path.join(folder, "data.jsonl"), "--out", out,
                           "--steps", str(steps), "--prompts-per-step", str(c["prompts"]), "--group-size", str(G),
                           "--minibatches", "1", "--micro-tokens", "1000000", "--max-prompt-len", "64",
                           "--max-response-len", str(c["tokens"]), "--engine", "hf", "--save-every", "0",
                           "--no-chat-template", "--checkpointing", "full"])
    stapo.train(args)
    dist.destroy_process_group()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    peaks = [max(v for k, v in r.items() if k.startswith("peak_gb/")) * 1024 for r in rows]
    return [r["step_s"] for r in rows], peaks


def peak_mb():
    """The resident set's high-water mark since the last call (Linux VmHWM), then reset."""
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return kb / 1024


def run_trl(folder, c, steps, checkpointing):
    """GRPOTrainer with the same batch: G completions of each prompt, one optimizer step per batch."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from reward import score_all
    with open(os.path.join(folder, "data.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    data = Dataset.from_list([{"prompt": r["problem"], "answer": r["answer"]} for r in rows] * steps * 2)

    def reward(completions, answer, **_):
        return score_all(completions, answer)

    class Clock(TrainerCallback):
        times = []

        peaks = []

        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self.t0)
            self.peaks.append(peak_mb())

    config = GRPOConfig(output_dir=os.path.join(folder, "trl_run"), per_device_train_batch_size=c["prompts"] * G,
                        num_generations=G, max_completion_length=c["tokens"], temperature=1.0, top_k=0,
                        epsilon_high=0.28, beta=0.0, bf16=False, gradient_checkpointing=checkpointing,
                        loss_type="dapo", max_steps=steps, learning_rate=1e-6, save_strategy="no",
                        report_to="none", use_cpu=True, logging_steps=1, disable_tqdm=True, shuffle_dataset=False)
    trainer = GRPOTrainer(model=folder, reward_funcs=reward, args=config, train_dataset=data, callbacks=[Clock()])
    trainer.train()
    return Clock.times, Clock.peaks


def child(a):
    import torch
    torch.set_num_threads(2)
    c = CONFIGS[a.config]
    if a.side == "trl":
        times, peaks = run_trl(a.folder, c, a.steps, a.trl_checkpointing == "on")
    else:
        times, peaks = run_stapo(a.folder, c, a.steps)
    peaks.append(peak_mb())  # after the last step: saving the model, teardown
    print(json.dumps({"step_s": statistics.median(times[1:] or times), "peak_mb": max(peaks), "steps": times,
                      "step_peaks_mb": peaks[:-1]}))


def spawn(python, side, a):
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [python, os.path.abspath(__file__), "--config", a.config, "--folder", a.folder, "--steps", str(a.steps),
           "--side", side, "--trl-checkpointing", a.trl_checkpointing]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=a.folder)
    if done.returncode:
        sys.exit(f"the {side} run failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(pairs):
    """pairs: [(TRL's run, stapo's run)]. The median pair (by TRL / stapo step, the lower middle for an even
    count), its steps and ratio, every pair's ratio, and each side's largest peak and their ratio."""
    ratios = [t["step_s"] / s["step_s"] for t, s in pairs]
    median = statistics.median_low(ratios)
    trl, ours = pairs[ratios.index(median)]
    peak_trl, peak_ours = max(t["peak_mb"] for t, _ in pairs), max(s["peak_mb"] for _, s in pairs)
    return {"summary": "vs_trl", "ratio": "the median of the per-pair ratios TRL step / stapo step",
            "trl_step_s": trl["step_s"], "stapo_step_s": ours["step_s"], "trl_over_stapo": median,
            "pair_ratios": ratios, "trl_peak_mb": peak_trl, "stapo_peak_mb": peak_ours,
            "stapo_over_trl_peak": peak_ours / peak_trl}


def print_table(c, a, x):
    """The summary x as the docs' table: the median pair's steps, their ratio, the peaks."""
    print(f"({a.config}) V={c['vocab']}, H={c['hidden']}, {c['prompts']} prompts x {G}, T={c['tokens']}, "
          f"{a.pairs} pairs of {a.steps} steps; both fp32; activation checkpointing: stapo on, "
          f"TRL {a.trl_checkpointing}")
    print("| TRL step (median pair) | stapo step (median pair) | TRL / stapo: median of pair ratios (each pair) "
          "| TRL peak RSS | stapo peak RSS (/ TRL's) |\n|---|---|---|---|---|")
    print(f"| {x['trl_step_s']:.3f} s | {x['stapo_step_s']:.3f} s | {x['trl_over_stapo']:.2f}x "
          f"({', '.join(f'{r:.2f}' for r in x['pair_ratios'])}) | {x['trl_peak_mb']:.0f} MB | "
          f"{x['stapo_peak_mb']:.0f} MB ({x['stapo_over_trl_peak']:.2f}x) |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trl-python", default=sys.executable, help="a python with TRL 1.16 (default: this one)")
    p.add_argument("--trl-checkpointing", choices=["on", "off"], default="on",
                   help="TRL's gradient_checkpointing (stapo: --checkpointing full)")
    p.add_argument("--config", choices=sorted(CONFIGS), default="a", help="the model and batch sizes (CONFIGS)")
    p.add_argument("--pairs", type=int, default=3, help="runs of each side, interleaved")
    p.add_argument("--steps", type=int, default=6, help="steps per run; the first is a warm-up")
    p.add_argument("--folder", default="/tmp/stapo_vs_trl", help="where the model and the runs go")
    p.add_argument("--only", choices=["trl", "stapo"], help="run one side (--pairs runs of it), no ratios")
    p.add_argument("--side", choices=["trl", "stapo"], help=argparse.SUPPRESS)
    import record
    record.add_flag(p)
    a = p.parse_args()
    a.folder = os.path.abspath(a.folder) + ("" if a.side else "_" + a.config)
    if a.side:
        return child(a)
    with record.kept(a.results, f"vs_trl_{a.config}"):
        run(a)


def run(a):
    os.makedirs(a.folder, exist_ok=True)
    build(a.folder, **CONFIGS[a.config])
    if a.only:
        for k in range(a.pairs):
            r = spawn(a.trl_python if a.only == "trl" else sys.executable, a.only, a)
            print(json.dumps({"run": k + 1, "side": a.only, **r}), flush=True)
            print(f"{a.only} run {k + 1}: step {r['step_s']:.3f} s, peak {r['peak_mb']:.0f} MB; per step: seconds "
                  f"{[round(x, 2) for x in r['steps']]}, peak MB {[round(x) for x in r['step_peaks_mb']]}")
        return
    pairs = []
    for k in range(a.pairs):
        trl, ours = spawn(a.trl_python, "trl", a), spawn(sys.executable, "stapo", a)
        pairs.append((trl, ours))
        print(json.dumps({"pair": k + 1, "trl": trl, "stapo": ours, "trl_over_stapo": trl["step_s"] / ours["step_s"]}),
              flush=True)
        print(f"pair {k + 1}: TRL {trl['step_s']:.3f} s {trl['peak_mb']:.0f} MB, stapo {ours['step_s']:.3f} s "
              f"{ours['peak_mb']:.0f} MB, ratio {trl['step_s'] / ours['step_s']:.2f}", flush=True)
    x = summary(pairs)
    print(json.dumps(x), flush=True)
    print_table(CONFIGS[a.config], a, x)


if __name__ == "__main__":
    main()
