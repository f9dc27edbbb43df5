"""The CPU toy: a tiny Qwen3 learns to carry (a + b, a < 100, 3 <= b < 10), STAPO beside JustRL, offline, on 2 cores.

    python examples/toy.py [--out runs/toy] [--seed 0]     # STAPO and JustRL side by side: what bash toy.sh runs
    python examples/toy.py --method stapo|justrl|grpo|entropy20|control   # one arm alone
    python examples/toy.py --method all --out runs/toy4    # the four objectives from one warm start, in turn
    python examples/toy.py --world add                     # the earlier world: the box alone (docs/toy.md)
    python examples/toy_compare.py                         # the arms over seeds (its docstring)

1. Builds a BPE tokenizer (with a chat template) and a 2-layer Qwen3 from scratch: no downloads.
2. Warm-starts it with a supervised phase run to convergence. Every answer is a fixed span, then the box:
   `I add them and box the sum: \\boxed{n}`. The span is taught with label noise: each of its 8 tokens is
   a random letter (of 52) 2% of the time (NOISE), so the model writes the span's word with p ~ 0.98 and a
   letter with p ~ 2e-4, far below the paper's tau_p = 0.002, at positions where it is confident (H ~ 0.15).
   The reward reads the box alone: a letter drawn in the span of a right answer does not cause its reward,
   and inherits the whole positive advantage: the paper's spurious token, by construction. And a sum that
   carries a ten is taught with the carry forgotten 4 times in 5 (37 + 5 -> 32): greedily the model gets
   about 0.4 of the held-out problems, those that do not carry; RL has to teach it to carry.
3. Runs the real trainer (stapo.train, imported, not copied) on 500 of the 700 problems "What is a + b?":
   by default STAPO and JustRL from the one warm start, as two processes side by side, one thread each
   (`--method` runs one arm alone, in this process). Each run logs S2T's set under its objective
   (silenced.jsonl: silenced under STAPO, trained on under JustRL) and the token analysis (--analysis).
4. Prints where S2T's set fell (the span, the box, after the box), its share of the response tokens and of
   JustRL's gradient, draws the runs' curves to <out>/curves.png, and ends with the greedy accuracy on the
   200 held-out problems, never trained on, before and after RL: `toy: stapo accuracy A -> B` and
   `toy: justrl accuracy A -> C` (one arm alone: `toy: accuracy A -> B`).
Each trained model lands in <out>/<arm>/rl/model (one arm alone: <out>/rl/model), loadable by transformers.

--world add is the earlier toy: the box alone, 32 prompts a step, tau_p = 0.05 (docs/toy.md says what S2T
silenced there: the very carries RL had to teach). --hard (the add world's) restates the sum before the box.
--method control is the positive control: JustRL with neither clip (the ratio's nor the gradient norm's) at
CONTROL_LR_FACTOR times the lr, an arm that has to go unstable, so that a null can be told from a measure that
cannot see instability.
"""
import argparse, json, os, random, shutil, signal, subprocess, sys, time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import curves  # noqa: E402
from checkpoint import used_out  # noqa: E402
from parallel import UserError, check_out, run_program  # noqa: E402
import stapo  # noqa: E402
from problems import SUFFIX, encode_prompt  # noqa: E402
from reward import score  # noqa: E402
from rollout import HFEngine  # noqa: E402

METHODS = ["stapo", "justrl", "grpo", "entropy20"]
ARMS = METHODS + ["control"]  # control: the positive control (see CONTROL)
PAIR = ["stapo", "justrl"]   # what the toy runs by default, side by side
HELD_OUT = 200
SFT_STEPS, SLIP = 1000, 0.8  # the warm start's steps, its slip (the carry forgotten that often)
SPAN, NOISE = "I add them and box the sum:", 0.02  # the span before the box, its per-token label noise
LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"  # what a noisy span token becomes
# Each world's RL: its steps, lr, prompts a step (8 samples each), updates a step, S2T's tau_p, response limit
WORLDS = {
    "span": dict(steps=250, lr=1e-3, prompts=16, minibatches=2, tau_p=0.002, max_tokens=18),
    "add": dict(steps=350, lr=5e-4, prompts=32, minibatches=2, tau_p=0.05, max_tokens=10),
}
STEPS, LR = WORLDS["span"]["steps"], WORLDS["span"]["lr"]
# The positive control: JustRL at this many times the lr, with the ratio's clips and the gradient norm's off
CONTROL_LR_FACTOR = 10
CONTROL = ["--eps-low", "0.999", "--eps-high", "1e9", "--clip-c", "1e9", "--grad-clip", "1e9"]

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def sums(hard=False):
    """The toy's (train, held out) rows: a + b for a < 100 and 3 <= b < 10, 500 to train on and 200 held out
    (the same in every world and with --hard; only the answer's form changes). 60% of them carry a ten."""
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
    sum restated first. (The span world puts SPAN before it: span_answer.)"""
    answer = row["answer"] if answer is None else answer
    boxed = f"\\boxed{{{answer}}}"
    if hard:
        return f"{row['a']} + {row['b']} = {answer}, so the answer is {boxed}"
    return boxed


def slipped(row):
    """The answer with the carry forgotten: the units of a + b, the tens of a (37 + 5 -> 32)."""
    return str(row["a"] // 10 * 10 + (row["a"] + row["b"]) % 10)


def span_answer(tok, answer, rng, noise):
    """The span world's answer as token ids: SPAN's tokens, each one a random letter with probability noise
    (drawn from rng), then ` \\boxed{answer}` and the end token."""
    span = [tok.convert_tokens_to_ids(rng.choice(LETTERS)) if rng.random() < noise else t
            for t in tok(SPAN, add_special_tokens=False)["input_ids"]]
    return span + tok(f" \\boxed{{{answer}}}<|im_end|>", add_special_tokens=False)["input_ids"]


def build_tokenizer(path, hard=False, span=False):
    """A byte-level BPE with one token per digit, trained in-process, saved and reloaded; span=True (the span
    world) adds SPAN to its corpus and room for 20 more merges (319 tokens: SPAN is one token per word)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    corpus = [r["problem"] + SUFFIX for r in problems()[0]] + [f"\\boxed{{{n}}}" for n in range(19)]
    if hard:
        corpus += [target(r, hard) for r in problems(hard)[0]]
    if span:
        corpus += [f"{SPAN} \\boxed{{1}}"] * 80
    tok.train_from_iterator(corpus * 4, trainers.BpeTrainer(show_progress=False,
        vocab_size=320 if span else 300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
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


def warm_start(model, tok, rows, steps=200, lr=3e-3, hard=False, slip=0.0, noise=None):
    """A supervised phase on `rows`. With slip > 0 (the toy's), a sum that carries a ten is taught with the
    carry forgotten (`slipped`) that often: the model learns the format, the sums that do not carry, and to
    forget the carry, at least on the sums it greedily answers; RL has to teach it to carry. noise (the span
    world's NOISE): each answer is span_answer's, SPAN with that label noise before the box; None: the box
    alone (or --hard's restatement). (slip = 0, the tests' small models: a short phase, stopped early.)"""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(1)
    for _ in range(steps):
        ids, labels = [], []
        for r in rng.sample(rows, 16):
            prompt = encode_prompt(tok, r["problem"])
            carries = slip > 0 and int(r["answer"]) // 10 != r["a"] // 10
            wrong = slipped(r) if carries and rng.random() < slip else None
            if noise is None:
                answer = tok(target(r, hard, wrong) + "<|im_end|>", add_special_tokens=False)["input_ids"]
            else:
                answer = span_answer(tok, r["answer"] if wrong is None else wrong, rng, noise)
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


@torch.no_grad()
def span_stats(model_path, tok, rows):
    """The model's span, read at the held-out prompts with the clean span and the right box after them: the
    mean entropy at the span's positions and the mean probability of anything but the span's own token there
    (the warm start's: about NOISE), and the mean entropy at the box's digits."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    span = tok(SPAN, add_special_tokens=False)["input_ids"]
    H, off, H_box = [], [], []
    for r in rows:
        prompt, answer = encode_prompt(tok, r["problem"]), span_answer(tok, r["answer"], random.Random(0), 0.0)
        logp = model(input_ids=torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
        h = -(logp.exp() * logp).sum(-1)
        H += h[:len(span)].tolist()
        off += (1 - logp[range(len(span)), span].exp()).tolist()
        H_box += h[len(span) + 3:len(span) + 3 + len(r["answer"])].tolist()  # after ` \\`, `boxed`, `{`
    return {"span_entropy": mean(H), "span_off": mean(off), "box_entropy": mean(H_box)}


def arm_flags(a, arm):
    """The trainer's --method and lr for an arm, and its extra flags (the positive control's: no clips)."""
    if arm == "control":
        return "justrl", a.lr * CONTROL_LR_FACTOR, CONTROL
    return arm, a.lr, []


def train_one(a, method, base, out):
    """One RL run of the toy from the warm start `base`: (seconds, its metrics.jsonl rows)."""
    t0 = time.time()
    objective, lr, extra = arm_flags(a, method)
    stapo.train(stapo.get_args([
        "--model", base, "--dataset", os.path.join(a.out, "train.jsonl"), "--out", out, "--method", objective,
        "--steps", str(a.steps), "--prompts-per-step", str(a.prompts), "--group-size", "8",
        "--minibatches", str(a.minibatches), "--micro-tokens", "4096", "--max-prompt-len", "64",
        "--max-response-len", str(a.max_tokens), "--lr", str(lr), "--warmup-steps", "0", "--weight-decay", "0",
        "--save-every", "0", "--tau-p", str(a.tau_p), "--log-silenced", "--analysis", "--seed", str(a.seed),
        "--reward", a.reward] + extra + (["--resume"] if a.resume else [])))
    seconds = time.time() - t0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return seconds, [json.loads(line) for line in f]


def s2t_set(run):
    """A run's S2T set as logged (--log-silenced: its silenced.jsonl records; none logged: [])."""
    path = os.path.join(run, "silenced.jsonl")
    return curves.read_jsonl(path) if os.path.exists(path) else []


def region(record, span_tokens):
    """Where a token of S2T's set fell (a silenced.jsonl record): "span" (one of the first span_tokens, before
    any backslash: the span the reward ignores), "box" (from the box's `\\` to its `}`) or "after" (past the
    closed box). The record's left context is 40 characters, enough for the toy's short answers."""
    left = record["left"]
    if record["t"] < span_tokens and "\\" not in left + record["token"]:
        return "span"
    opened = left.rfind("\\boxed{")
    closed = opened >= 0 and "}" in left[opened:]
    return "after" if closed or (opened < 0 and record["t"] >= span_tokens + 3) else "box"


def regions(records, span_tokens):
    """{region: how many of the records fell there}, in the order span, box, after."""
    counts = dict.fromkeys(("span", "box", "after"), 0)
    for r in records:
        counts[region(r, span_tokens)] += 1
    return counts


def span_length(tok, world):
    return len(tok(SPAN, add_special_tokens=False)["input_ids"]) if world == "span" else 0


def s2t_summary(run, method, samples_per_step, span_tokens=0):
    """The lines that say what S2T's set was in a run: the count, its fraction of the response tokens, where
    it fell, whether the run silenced it (stapo) or trained on it, and three of the tokens in their context (the
    first, the middle and the last of the run's silenced.jsonl)."""
    rows = curves.read_jsonl(os.path.join(run, "metrics.jsonl"))
    tokens = sum(r["response_len_mean"] for r in rows) * samples_per_step
    path = os.path.join(run, "silenced.jsonl")
    found = s2t_set(run)
    steps = len({r["step"] for r in found})
    done = "silenced" if method == "stapo" else f"trained on (--method {method} silences nothing)"
    n = regions(found, span_tokens)
    where = (f"{n['span']} in the span, " if span_tokens else "") + f"{n['box']} in the box, {n['after']} after it"
    lines = [f"S2T's set under {method}: {len(found)} of {tokens:.0f} response tokens ({len(found) / tokens:.1e}), "
             f"in {steps} of {len(rows)} steps, {done}; {where}; each is in {path}"]
    picks = sorted({0, len(found) // 2, len(found) - 1}) if found else []
    for r in (found[i] for i in picks):
        context = f"{r['left']}[[{r['token']}]]{r['right']}".replace("\n", " ")
        lines.append(f"  step {r['step']}: p = {r['p']:.3g}, H = {r['H']:.3g}:  {context!r}")
    return lines


def grad_share(rows, key="grad_share/silenced"):
    """The mean over a run's steps of an analysis share (steps with none left out), or None."""
    xs = [r[key] for r in rows if r.get(key) is not None]
    return sum(xs) / len(xs) if xs else None


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


def draw_pair(runs, out, window=10):
    """runs: {arm: its run folder}. One PNG, the arms side by side: training accuracy, token entropy (all
    tokens, and at S2T's set), and S2T's set's share of the gradient (as applied; dashed: were it kept)."""
    plt = curves.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, (arm, run) in zip(colors, runs.items()):
        rows = curves.read_jsonl(os.path.join(run, "metrics.jsonl"))
        steps = [r["step"] for r in rows]
        series = lambda key: curves.smooth([r.get(key) or 0.0 for r in rows], window)  # noqa: E731
        axes[0].plot(steps, series("accuracy"), color=color, label=arm)
        axes[1].plot(steps, series("entropy_mean"), color=color, label=f"{arm}: all tokens")
        at = [(r["step"], r["taxonomy/posA_lowP_lowH/entropy"]) for r in rows
              if r.get("taxonomy/posA_lowP_lowH/entropy") is not None]
        axes[1].plot(*zip(*at), ".", color=color, ms=3, label=f"{arm}: at S2T's set") if at else None
        axes[2].plot(steps, [100 * x for x in series("grad_share/silenced")], color=color, label=f"{arm}: applied")
        axes[2].plot(steps, [100 * x for x in series("grad_share/silenced_if_kept")], "--", color=color,
                     label=f"{arm}: were it kept")
    for ax, title, ylabel in zip(axes, ("Training accuracy (sampled)", "Token entropy", "S2T's set's gradient share"),
                                 (f"{window}-step mean", "nats", f"% of Σ‖∇_a‖², {window}-step mean")):
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[1].set_yscale("log")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return out


# What a flag's value must be, checked before anything is built (the trainer would say so after the warm start)
BOUNDS = [("steps", "steps", lambda v: v >= 1, "at least 1"), ("sft-steps", "sft_steps", lambda v: v >= 1,
          "at least 1"), ("prompts", "prompts", lambda v: v >= 1, "at least 1"),
          ("minibatches", "minibatches", lambda v: v >= 1, "at least 1"), ("lr", "lr", lambda v: v > 0, "above 0"),
          ("tau-p", "tau_p", lambda v: 0 < v < 1, "in (0, 1)"), ("max-tokens", "max_tokens", lambda v: v >= 1,
          "at least 1")]


def add_world_flags(p):
    """The world and the flags that override its RL settings (WORLDS), and the warm start's: the toy's and
    examples/toy_compare.py's."""
    p.add_argument("--world", default="span", choices=list(WORLDS), help="span: the span before the box (the "
                   "default); add: the earlier toy, the box alone")
    p.add_argument("--steps", type=int, help="RL steps (the world's)")
    p.add_argument("--lr", type=float, help="the RL learning rate (the world's)")
    p.add_argument("--prompts", type=int, help="prompts per step (the world's)")
    p.add_argument("--minibatches", type=int, help="optimizer updates per step (the world's)")
    p.add_argument("--tau-p", type=float, help="S2T's tau_p (the world's)")
    p.add_argument("--max-tokens", type=int, help="the response limit (the world's; --hard: 24)")
    p.add_argument("--sft-steps", type=int, default=SFT_STEPS, help="the warm start's supervised steps")
    p.add_argument("--hard", action="store_true", help="the add world's longer answers: the sum restated")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/toy", help="the warm start and each arm's run go here")
    p.add_argument("--method", default="pair", choices=["pair"] + ARMS + ["all"], help="pair (the default): "
                   "stapo and justrl side by side; one arm alone (stapo.py's --method, or control); or all four "
                   "objectives in turn")
    add_world_flags(p)
    p.add_argument("--seed", type=int, default=0, help="the RL run's sampling seed (the warm start stays the same)")
    p.add_argument("--reward", default="equiv", choices=["equiv", "dapo"], help="stapo.py's --reward")
    p.add_argument("--base", default="", help="start RL from this warm start (a toy run's <out>/base) instead "
                   "of training one: how examples/toy_compare.py gives every run the same one")
    p.add_argument("--no-figure", dest="figure", action="store_false", help="skip the PNG of the run's curves")
    p.add_argument("--resume", action="store_true", help="continue an interrupted toy run in --out: its warm "
                   "start and each finished arm kept, an arm stopped by Ctrl-C continued from its checkpoint")
    a = p.parse_args(argv)
    for flag, value, ok, what in BOUNDS:
        value = getattr(a, value)
        if value is not None and not ok(value):
            raise UserError(f"--{flag} {value}: must be {what}")
    check_out(a.out)
    if a.hard and a.world != "add":
        raise UserError("--hard is the add world's (--world add)")
    for key, value in WORLDS[a.world].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.hard and a.max_tokens == WORLDS[a.world]["max_tokens"]:
        a.max_tokens = 24
    return p, a


def prepare(a):
    """Refuse a used --out, write the training problems, and build the warm start (or take --base):
    (tokenizer, the warm start's folder, the held-out rows). The span world runs on one thread from here on, so
    that the warm start's weights and a run's samples do not depend on the machine's core count."""
    runs = {"all": METHODS, "pair": [f"{m}/rl" for m in PAIR]}.get(a.method, ["rl"])
    held = {run: used_out(os.path.join(a.out, run)) for run in runs}
    held = [f"{run}/ holds {what}" for run, what in held.items() if what]
    if held and not a.resume:  # refused before the warm start, not by the trainer after it
        raise UserError(f"--out {a.out} holds an earlier toy run ({'; '.join(held)}): continue it with --resume, write "
                f"this one to another --out (bash toy.sh --out runs/toy2), or delete {a.out}")
    if a.world == "span":
        torch.set_num_threads(1)
    train, held_out = sums(a.hard)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "train.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in train)
    if a.base:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(a.base), a.base, held_out
    base = os.path.join(a.out, "base")
    if not (a.resume and os.path.isdir(base)):  # a base/ is whole: it is renamed into place only when built
        build_base(a, train, base)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(base), base, held_out


def build_base(a, train, base):
    """The warm start, built in base.partial and renamed to `base` once saved: an interrupted one leaves no base/."""
    print(f"warm start: {a.sft_steps} supervised steps on one thread (about 30 s), then RL", flush=True)
    partial = base + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        tok = build_tokenizer(partial, a.hard, span=a.world == "span")
        noise = NOISE if a.world == "span" else None
        model = warm_start(build_model(partial, tok), tok, train, steps=a.sft_steps, hard=a.hard, slip=SLIP,
                           noise=noise)
        model.save_pretrained(partial)
        os.replace(partial, base)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def main(argv=None):
    p, a = parse(argv)
    import transformers
    transformers.utils.logging.disable_progress_bar()  # its save's "Writing model shards" bars, 2 per model
    tok, base, held_out = prepare(a)
    if a.method == "pair":
        return run_pair(a, base, tok)
    before = greedy_accuracy(base, tok, held_out, a.max_tokens)
    if a.method == "all":
        return compare_all(a, base, tok, held_out, before)
    run = os.path.join(a.out, "rl")
    if a.resume and os.path.exists(os.path.join(a.out, "result.json")):
        seconds = json.load(open(os.path.join(a.out, "result.json")))["rl_seconds"]  # it had finished
    else:
        seconds, _ = train_one(a, a.method, base, run)
    after = greedy_accuracy(os.path.join(run, "model"), tok, held_out, a.max_tokens)
    result = {"before": before, "after": after, "held_out": len(held_out), "rl_seconds": seconds, "world": a.world}
    if a.world == "span":
        result["span_tokens"] = span_length(tok, a.world)
        result["span"] = {"before": span_stats(base, tok, held_out),
                          "after": span_stats(os.path.join(run, "model"), tok, held_out)}
    with open(os.path.join(a.out, "result.json"), "w") as f:
        json.dump(result, f)
    print("\n".join(s2t_summary(run, a.method, a.prompts * 8, span_length(tok, a.world))))
    if a.figure:
        print(f"the run's curves: {draw_run(run, os.path.join(a.out, 'curves.png'), a.prompts * 8)}")
    print(f"held-out accuracy: greedy, on the {len(held_out)} problems never trained on")
    print(f"toy: accuracy {before:.2f} -> {after:.2f}")
    return before, after


def arm_command(a, arm, base, out):
    """The command that runs one arm alone from the warm start `base` into `out`, with every setting of this
    run's (so that the arm runs as it would here)."""
    settings = {"--seed": a.seed, "--steps": a.steps, "--lr": a.lr, "--prompts": a.prompts, "--minibatches":
                a.minibatches, "--tau-p": a.tau_p, "--max-tokens": a.max_tokens, "--reward": a.reward}
    return [sys.executable, os.path.abspath(__file__), "--out", out, "--world", a.world, "--method", arm, "--base",
            base, "--no-figure"] + [str(x) for pair in settings.items() for x in pair]


def run_pair(a, base, tok, every=None):
    """The default: STAPO and JustRL from the one warm start, side by side, each its own process on one thread
    (its log in <out>/<arm>/run.log); a progress line every tenth of the run; then what S2T's set was, the
    figure, and a line per arm."""
    every = every or max(a.steps // 10, 1)
    procs = {}
    for arm in PAIR:
        folder = os.path.join(a.out, arm)
        os.makedirs(folder, exist_ok=True)
        if a.resume and os.path.exists(os.path.join(folder, "result.json")):
            continue  # finished before the interruption
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        log = open(os.path.join(folder, "run.log"), "a" if a.resume else "w")
        command = arm_command(a, arm, base, folder) + (["--resume"] if a.resume else [])
        procs[arm] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    print(f"STAPO and JustRL, side by side from one warm start, {a.steps} steps each (seed {a.seed}); "
          f"their logs: {a.out}/<arm>/run.log", flush=True)
    shown = 0
    try:
        while any(proc.poll() is None for proc in procs.values()):
            time.sleep(1)
            if any(proc.poll() for proc in procs.values()):  # one failed: the other's result would be alone
                for proc in procs.values():
                    proc.poll() is None and proc.terminate()
                break
            rows = {arm: read_rows(os.path.join(a.out, arm, "rl", "metrics.jsonl")) for arm in PAIR}
            while min(map(len, rows.values())) >= shown + every:
                shown += every
                print(f"step {shown}/{a.steps}: " + " | ".join(
                    f"{arm} accuracy {mean(r['accuracy'] for r in rows[arm][shown - every:shown]):.2f}, entropy "
                    f"{mean(r['entropy_mean'] for r in rows[arm][shown - every:shown]):.3f}" for arm in PAIR),
                    flush=True)
    except KeyboardInterrupt:  # the arms got Ctrl-C too (or get it here): each checkpoints its step and exits
        for proc in procs.values():
            proc.poll() is None and proc.send_signal(signal.SIGINT)
        for proc in procs.values():
            proc.wait()
        print(f"toy.py: stopped by Ctrl-C; each arm kept its last step (its log: {a.out}/<arm>/run.log). "
              f"To continue: the same command with --resume", file=sys.stderr)
        raise SystemExit(130) from None
    failed = [arm for arm, proc in procs.items() if proc.returncode]
    if failed:
        sys.exit(f"the {failed[0]} run failed: see {os.path.join(a.out, failed[0], 'run.log')}")
    results = {arm: json.load(open(os.path.join(a.out, arm, "result.json"))) for arm in PAIR}
    runs = {arm: os.path.join(a.out, arm, "rl") for arm in PAIR}
    k = span_length(tok, a.world)
    for arm in PAIR:
        print("\n".join(s2t_summary(runs[arm], arm, a.prompts * 8, k)))
    if a.figure:
        print(f"the runs' curves: {draw_pair(runs, os.path.join(a.out, 'curves.png'))}")
    print(f"one seed shows a trajectory, not an effect: docs/toy.md's study over seeds says what silencing does")
    print(f"held-out accuracy: greedy, on the {HELD_OUT} problems never trained on")
    print(pair_line(runs, a.prompts * 8, k))
    for arm in PAIR:
        print(f"toy: {arm} accuracy {results[arm]['before']:.2f} -> {results[arm]['after']:.2f}")
    return {arm: (r["before"], r["after"]) for arm, r in results.items()}


def pair_line(runs, samples_per_step, span_tokens):
    """The line that gives S2T's set's size under STAPO (silenced there: its share of the response tokens, and
    how much of it fell in the span) and its share of JustRL's gradient (trained on there)."""
    rows = curves.read_jsonl(os.path.join(runs["stapo"], "metrics.jsonl"))
    tokens = sum(r["response_len_mean"] for r in rows) * samples_per_step
    found = s2t_set(runs["stapo"])
    where = regions(found, span_tokens)
    share = grad_share(curves.read_jsonl(os.path.join(runs["justrl"], "metrics.jsonl")))
    in_span = f", {100 * where['span'] / len(found):.0f}% of them in the span" if found and span_tokens else ""
    return (f"the silenced tokens: {100 * len(found) / tokens:.2f}% of STAPO's response tokens{in_span}; S2T's "
            f"set carried {100 * (share or 0):.1f}% of JustRL's gradient (Σ‖∇_a‖², the mean over steps)")


def read_rows(path):
    """A metrics.jsonl being written: its complete lines (none before it exists)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs)


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
    run_program(main)  # Ctrl-C in the warm start, say: one line (it leaves no base/), exit code 130
