"""The CPU toy: a tiny Qwen3 learns to carry (a + b, a < 100, 3 <= b < 10) with STAPO, offline, on 2 cores.

    python examples/toy.py [--out runs/toy] [--method stapo|justrl|grpo|entropy20] [--steps 350] [--seed 0]
    python examples/toy.py --method all --out runs/toy4    # the four objectives from one warm start
    python examples/toy_compare.py                         # STAPO against JustRL over seeds (its docstring)

1. Builds a BPE tokenizer (with a chat template) and a 2-layer Qwen3 from scratch: no downloads.
2. Warm-starts it with a supervised phase run to convergence, in which a sum that carries a ten is taught
   with the carry forgotten 4 times in 5 (37 + 5 -> 32): it learns the `\\boxed{n}` format, the sums that
   do not carry, and the slip; greedily it gets about 0.4 of the held-out problems, those that do not carry.
3. Runs the real trainer (stapo.train, imported, not copied) on 500 of the 700 problems "What is a + b?".
4. Prints what S2T silenced (how many tokens, their fraction of the response tokens, three of them in their
   context), draws the run's curves to <out>/curves.png, and ends with the greedy accuracy on the 200
   held-out problems, never trained on, before and after RL: `toy: accuracy A -> B`.
The trained model lands in <out>/rl/model, loadable by transformers and eval.py. With --method all, each
objective trains from the same warm start with the same seeds into <out>/<method>; a table compares them
and <out>/curves.png draws their curves (curves.py).

--hard makes the answers longer: the answer restates the sum before boxing it, "12 + 5 = 17, so the answer
is \\boxed{17}". Only the box is graded, so a sampled slip in the restatement can sit inside a correct
answer: a spurious token.
"""
import argparse, json, os, random, sys, time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import curves  # noqa: E402
from checkpoint import used_out  # noqa: E402
import stapo  # noqa: E402
from problems import SUFFIX, encode_prompt  # noqa: E402
from reward import score  # noqa: E402
from rollout import HFEngine  # noqa: E402

METHODS = ["stapo", "justrl", "grpo", "entropy20"]
HELD_OUT = 200
SFT_STEPS, STEPS, LR, SLIP = 1000, 350, 5e-4, 0.8  # the warm start's steps, RL's steps and lr, the slip

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def sums(hard=False):
    """The toy's (train, held out) rows: a + b for a < 100 and 3 <= b < 10, 500 to train on and 200 held out
    (the same with --hard; only the answer's form changes). 60% of them carry a ten."""
    pairs = [(a, b) for a in range(100) for b in range(3, 10)]
    random.Random(0).shuffle(pairs)
    as_rows = [{"problem": f"What is {a} + {b}?", "answer": str(a + b), "a": a, "b": b} for a, b in pairs]
    return as_rows[:-HELD_OUT], as_rows[-HELD_OUT:]


def problems(hard=False):
    """The small sets the tests' models warm-start on (and the tokenizer's corpus): a + b for a < 10 (20 held
    out), or with hard a < 20 (40 held out)."""
    pairs = [(a, b) for a in range(20 if hard else 10) for b in range(10)]
    random.Random(0).shuffle(pairs)
    as_rows = [{"problem": f"What is {a} + {b}?", "answer": str(a + b), "a": a, "b": b} for a, b in pairs]
    held_out = 40 if hard else 20
    return as_rows[:-held_out], as_rows[-held_out:]


def target(row, hard, answer=None):
    """The warm start's answer text (the row's answer, or the one given): the box alone, or with --hard the
    sum restated first."""
    answer = row["answer"] if answer is None else answer
    boxed = f"\\boxed{{{answer}}}"
    if hard:
        return f"{row['a']} + {row['b']} = {answer}, so the answer is {boxed}"
    return boxed


def slipped(row):
    """The answer with the carry forgotten: the units of a + b, the tens of a (37 + 5 -> 32)."""
    return str(row["a"] // 10 * 10 + (row["a"] + row["b"]) % 10)


def build_tokenizer(path, hard=False):
    """A byte-level BPE with one token per digit, trained in-process, saved and reloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    corpus = [r["problem"] + SUFFIX for r in problems()[0]] + [f"\\boxed{{{n}}}" for n in range(19)]
    if hard:
        corpus += [target(r, hard) for r in problems(hard)[0]]
    tok.train_from_iterator(corpus * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def build_model(path, tok, hidden=64, layers=2, tied=False):
    """A Qwen3 of the given size; tied=True shares the input embedding with the LM head (Qwen3-0.6B to 4B)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=256,
                      tie_word_embeddings=tied, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None)
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(path)
    return model


def warm_start(model, tok, rows, steps=200, lr=3e-3, hard=False, slip=0.0):
    """A supervised phase on `rows`. With slip > 0 (the toy's), a sum that carries a ten is taught with the
    carry forgotten (`slipped`) that often: the model learns the format, the sums that do not carry, and to
    forget the carry, at least on the sums it greedily answers; RL has to teach it to carry. (slip = 0, the
    tests' small models: a short phase, stopped early.)"""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(1)
    for _ in range(steps):
        ids, labels = [], []
        for r in rng.sample(rows, 16):
            prompt = encode_prompt(tok, r["problem"])
            carries = slip > 0 and int(r["answer"]) // 10 != r["a"] // 10
            wrong = slipped(r) if carries and rng.random() < slip else None
            answer = tok(target(r, hard, wrong) + "<|im_end|>", add_special_tokens=False)["input_ids"]
            ids.append(prompt + answer)
            labels.append([-100] * len(prompt) + answer)
        n = max(map(len, ids))
        ids = torch.tensor([x + [tok.pad_token_id] * (n - len(x)) for x in ids])
        labels = torch.tensor([y + [-100] * (n - len(y)) for y in labels])
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def greedy_accuracy(model_path, tok, rows, max_tokens):
    engine = HFEngine(model_path, torch.device("cpu"), torch.float32, tok.eos_token_id)
    prompts = [encode_prompt(tok, r["problem"]) for r in rows]
    outs = engine.generate(prompts, 1, 0.0, 1.0, max_tokens, [0] * len(rows))
    return sum(score(tok.decode(o[0].tokens), r["answer"]) > 0 for o, r in zip(outs, rows)) / len(rows)


def train_one(a, method, base, out):
    """One RL run of the toy from the warm start `base`: (seconds, its metrics.jsonl rows)."""
    t0 = time.time()
    stapo.train(stapo.get_args([
        "--model", base, "--dataset", os.path.join(a.out, "train.jsonl"), "--out", out, "--method", method,
        "--steps", str(a.steps), "--prompts-per-step", str(a.prompts), "--group-size", "8",
        "--minibatches", str(a.minibatches), "--micro-tokens", "4096", "--max-prompt-len", "64",
        "--max-response-len", str(a.max_tokens), "--lr", str(a.lr), "--warmup-steps", "0", "--weight-decay", "0",
        "--save-every", "0", "--tau-p", "0.05", "--log-silenced", "--analysis", "--seed", str(a.seed),
        "--reward", a.reward]))
    seconds = time.time() - t0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return seconds, [json.loads(line) for line in f]


def s2t_summary(run, method, samples_per_step):
    """The lines that say what S2T silenced in a run: the count, its fraction of the response tokens, and
    three of the tokens in their context (the first, the middle and the last of the run's silenced.jsonl)."""
    rows = curves.read_jsonl(os.path.join(run, "metrics.jsonl"))
    tokens = sum(r["response_len_mean"] for r in rows) * samples_per_step
    if method != "stapo":
        return [f"S2T: --method {method} silences nothing ({tokens:.0f} response tokens, all trained on)"]
    path = os.path.join(run, "silenced.jsonl")
    silenced = curves.read_jsonl(path) if os.path.exists(path) else []
    steps = len({r["step"] for r in silenced})
    lines = [f"S2T silenced {len(silenced)} of {tokens:.0f} response tokens ({len(silenced) / tokens:.1e}), "
             f"in {steps} of {len(rows)} steps; each is in {path}"]
    picks = sorted({0, len(silenced) // 2, len(silenced) - 1}) if silenced else []
    for r in (silenced[i] for i in picks):
        context = f"{r['left']}[[{r['token']}]]{r['right']}".replace("\n", " ")
        lines.append(f"  step {r['step']}: p = {r['p']:.3g}, H = {r['H']:.3g}:  {context!r}")
    return lines


def draw_run(run, out, samples_per_step, window=10):
    """The run's curves in one PNG: reward and training accuracy, entropy, tokens silenced per step."""
    plt = curves.pyplot()
    rows = curves.read_jsonl(os.path.join(run, "metrics.jsonl"))
    steps = [r["step"] for r in rows]
    panels = [("Reward and accuracy (training samples)", {"reward": "reward_mean", "accuracy": "accuracy"}, ""),
              ("Token entropy", {"entropy": "entropy_mean"}, "nats"),
              ("Tokens S2T silenced", {"silenced": "silenced_frac"}, "per step")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    for ax, (title, keys, ylabel) in zip(axes, panels):
        for label, key in keys.items():
            ys = [r[key] for r in rows]
            if key == "silenced_frac":  # a count: the fraction times the step's response tokens
                ys = [round(y * r["response_len_mean"] * samples_per_step) for y, r in zip(ys, rows)]
                ax.plot(steps, ys, ".", label=label)
            else:
                ax.plot(steps, curves.smooth(ys, window), label=f"{label} ({window}-step mean)")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return out


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/toy", help="the model and each method's run go here")
    p.add_argument("--method", default="stapo", choices=METHODS + ["all"], help="stapo.py's --method, or all four")
    p.add_argument("--steps", type=int, default=STEPS, help="RL steps")
    p.add_argument("--lr", type=float, default=LR, help="the RL learning rate")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step")
    p.add_argument("--minibatches", type=int, default=2, help="optimizer updates per step")
    p.add_argument("--sft-steps", type=int, default=SFT_STEPS, help="the warm start's supervised steps")
    p.add_argument("--hard", action="store_true", help="longer answers: the sum restated before the box")
    p.add_argument("--seed", type=int, default=0, help="the RL run's sampling seed (the warm start stays the same)")
    p.add_argument("--reward", default="equiv", choices=["equiv", "dapo"], help="stapo.py's --reward")
    p.add_argument("--base", default="", help="start RL from this warm start (a toy run's <out>/base) instead "
                   "of training one: how examples/toy_compare.py gives every run the same one")
    p.add_argument("--no-figure", dest="figure", action="store_false", help="skip the PNG of the run's curves")
    a = p.parse_args(argv)
    a.max_tokens = 24 if a.hard else 10
    return p, a


def prepare(a, p=None):
    """Refuse a used --out, write the training problems, and build the warm start (or take --base):
    (tokenizer, the warm start's folder, the held-out rows)."""
    runs = METHODS if a.method == "all" else ["rl"]
    held = {run: used_out(os.path.join(a.out, run)) for run in runs}
    held = [f"{run}/ holds {what}" for run, what in held.items() if what]
    if held and p is not None:  # refused before the warm start, not by the trainer after it
        p.error(f"--out {a.out} holds an earlier toy run ({'; '.join(held)}): write this one to another --out "
                f"(bash toy.sh --out runs/toy2), or delete {a.out}")
    train, held_out = sums(a.hard)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "train.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in train)
    if a.base:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(a.base), a.base, held_out
    base = os.path.join(a.out, "base")
    tok = build_tokenizer(base, a.hard)
    model = warm_start(build_model(base, tok), tok, train, steps=a.sft_steps, hard=a.hard, slip=SLIP)
    model.save_pretrained(base)
    return tok, base, held_out


def main(argv=None):
    p, a = parse(argv)
    tok, base, held_out = prepare(a, p)
    before = greedy_accuracy(base, tok, held_out, a.max_tokens)
    if a.method == "all":
        return compare_all(a, base, tok, held_out, before)
    run = os.path.join(a.out, "rl")
    seconds, _ = train_one(a, a.method, base, run)
    after = greedy_accuracy(os.path.join(run, "model"), tok, held_out, a.max_tokens)
    with open(os.path.join(a.out, "result.json"), "w") as f:
        json.dump({"before": before, "after": after, "held_out": len(held_out), "rl_seconds": seconds}, f)
    print("\n".join(s2t_summary(run, a.method, a.prompts * 8)))
    if a.figure:
        print(f"the run's curves: {draw_run(run, os.path.join(a.out, 'curves.png'), a.prompts * 8)}")
    print(f"held-out accuracy: greedy, on the {len(held_out)} problems never trained on")
    print(f"toy: accuracy {before:.2f} -> {after:.2f}")
    return before, after


def compare_all(a, base, tok, held_out, before):
    """--method all: the four objectives from one warm start, a table and their curves."""
    table = ["| objective | held-out accuracy | final entropy (last 10 steps) | mean silenced fraction | wall time |",
             "|---|---|---|---|---|"]
    for method in METHODS:
        seconds, m = train_one(a, method, base, os.path.join(a.out, method))
        after = greedy_accuracy(os.path.join(a.out, method, "model"), tok, held_out, a.max_tokens)
        entropy = sum(x["entropy_mean"] for x in m[-10:]) / len(m[-10:])
        silenced = sum(x["silenced_frac"] for x in m) / len(m)
        table.append(f"| {method} | {before:.2f} -> {after:.2f} | {entropy:.3f} | {silenced:.1e} | {seconds:.0f} s |")
    print("\n".join(table))
    curves.draw_curves({m: os.path.join(a.out, m) for m in METHODS}, os.path.join(a.out, "curves.png"), window=10)
    return table


if __name__ == "__main__":
    try:
        main()
    finally:  # a process group alive at exit can abort the process
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
