"""Reference runs: fixed-seed training runs whose metrics a change that means to alter nothing must leave equal,
key by key, against the trainer of a known-good commit (BASELINE).

    python tests/reference.py --write            # record BASELINE's runs for this machine (tests/data/reference)
    python tests/reference.py OUT [RUN[:STEPS] ...]   # this tree's runs into OUT, all or the first STEPS steps

Runs: the toy (its warm start, then 40 steps of STAPO, the token analysis on) on one rank, on two, and in one
micro-batch, and 3 steps through vLLM's CPU build on two ranks. Each is a subprocess with one thread, so the
float order is the same every time. The learning rate is constant (no warm-up), so a shorter run's steps are
the first steps of the recorded one: tests/test_reference.py reruns a prefix of each to keep CI short.

The numbers hold for one machine's float kernels: another CPU (another vector width, another BLAS) warm-starts
the toy to other weights, and every sampled token after that differs. So a recording is named for the warm
start it began from, <run>-<id>.jsonl with id a hash of the warm-started weights. A machine whose warm start
has none runs BASELINE's trainer itself (its files from git, on the same warm start) beside this tree's, and
compares the two: the guard holds on any CPU, at twice the time. That takes BASELINE's commit in this clone's
history: a shallow clone stops with one line that says how to fetch it (git fetch --unshallow).
"""
import hashlib
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "data", "reference")
BASELINE = open(os.path.join(GOLDEN, "BASELINE")).read().split()[0]  # the commit whose trainer is the reference
sys.path.insert(0, ROOT)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
# What varies from run to run by nature: time and memory
VARYING = {"rollout_s", "train_s", "step_s", "tokens_per_s"}


def toy_model(d, hidden=64, tied=False):
    """The tests' one warm start: a 300-token BPE (one token per digit) and a 2-layer Qwen3 of `hidden` (tied:
    its embedding is its LM head), warm-started for 120 supervised steps on 80 of the 100 sums a + b < 19 into
    d/model, with those problems in d/train.jsonl; returns the tokenizer. It is the CPU toy of BASELINE, kept
    here as it was: the toy may change its design, while the tests' recordings name these weights."""
    import random
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    from problems import SUFFIX, encode_prompt
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(0).shuffle(pairs)
    train = [{"problem": f"What is {a} + {b}?", "answer": str(a + b), "a": a, "b": b} for a, b in pairs][:80]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    bpe.decoder = decoders.ByteLevel()
    corpus = [r["problem"] + SUFFIX for r in train] + [f"\\boxed{{{n}}}" for n in range(19)]
    bpe.train_from_iterator(corpus * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    path = os.path.join(d, "model")
    fast.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=256,
        tie_word_embeddings=tied, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None))
    model.save_pretrained(path)
    opt, rng = torch.optim.AdamW(model.parameters(), lr=3e-3), random.Random(1)
    for _ in range(120):
        ids, labels = [], []
        for r in rng.sample(train, 16):
            prompt = encode_prompt(tok, r["problem"])
            answer = tok(f"\\boxed{{{r['answer']}}}<|im_end|>", add_special_tokens=False)["input_ids"]
            ids.append(prompt + answer)
            labels.append([-100] * len(prompt) + answer)
        n = max(map(len, ids))
        ids = torch.tensor([x + [tok.pad_token_id] * (n - len(x)) for x in ids])
        labels = torch.tensor([y + [-100] * (n - len(y)) for y in labels])
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(path)
    with open(os.path.join(d, "train.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in train)
    return tok


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def flags(d, out, steps, *extra):
    return ["--model", os.path.join(d, "model"), "--dataset", os.path.join(d, "train.jsonl"), "--out", out,
            "--steps", str(steps), "--prompts-per-step", "16", "--group-size", "8", "--minibatches", "2",
            "--micro-tokens", "256", "--max-prompt-len", "64", "--max-response-len", "8", "--lr", "5e-4",
            "--warmup-steps", "0", "--weight-decay", "0", "--save-every", "0", "--tau-p", "0.05",
            "--log-silenced", "--seed", "0", *extra]


def train(argv, nproc, root=ROOT):
    """root's stapo.py on argv, as one process or under torchrun; a trainer that has the switch runs with
    --analysis (BASELINE's always ran the analysis)."""
    trainer = os.path.join(root, "stapo.py")
    argv += ["--analysis"] if '"--analysis"' in open(trainer).read() else []
    launch = [sys.executable] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    r = subprocess.run(launch + [trainer, *argv], capture_output=True, text=True, cwd=root, env=ENV, timeout=900)
    if r.returncode:
        raise RuntimeError(r.stderr[-4000:])


RUNS = {  # name: (model's hidden size, steps, ranks, extra flags)
    "toy_1rank": (64, 40, 1, ()),
    "toy_2ranks": (64, 40, 2, ()),
    "toy_one_micro_batch": (64, 40, 1, ("--micro-tokens", "4096")),
    "vllm_2ranks": (128, 3, 2, ("--engine", "vllm", "--tau-p", "0.5")),
}


def run(name, out, steps=None, root=ROOT):
    """One reference run of root's trainer into out/<name>, all its steps or the first `steps`; returns its
    metrics rows. Runs with the same hidden size share one warm-started model under out."""
    hidden, all_steps, nproc, extra = RUNS[name]
    model = os.path.join(out, f"model_{hidden}")
    if not os.path.exists(os.path.join(model, "train.jsonl")):
        toy_model(model, hidden)
    train(flags(model, os.path.join(out, name), steps or all_steps, *extra), nproc, root)
    return [json.loads(line) for line in open(os.path.join(out, name, "metrics.jsonl"))]


def warm_start_id(out, name):
    """A hash of the warm-started weights run `name` began from (under out): which recording applies."""
    model = os.path.join(out, f"model_{RUNS[name][0]}", "model", "model.safetensors")
    with open(model, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


def golden(name, out):
    """The recording of run `name` for the warm start under out (it may not exist)."""
    return os.path.join(GOLDEN, f"{name}-{warm_start_id(out, name)}.jsonl")


def comparable(row):
    """A metrics row without what varies by nature: timings and memory peaks."""
    return {k: v for k, v in row.items() if k not in VARYING and not k.startswith(("peak_gb/", "seconds/"))}


class NoBaseline(RuntimeError):
    """BASELINE's commit is not in this clone's history (a shallow clone): its message is one line, the fix."""


def baseline_tree(where):
    """BASELINE's files, from this repository's git history, under `where`; returns that folder. A clone
    without BASELINE's commit (git clone --depth 1, as CI services make) raises NoBaseline, saying how to
    fetch it."""
    tree = os.path.join(where, f"baseline-{BASELINE[:8]}")
    if not os.path.exists(tree):
        archive = subprocess.run(["git", "-C", ROOT, "archive", BASELINE], capture_output=True)
        if archive.returncode:
            said = (archive.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[0]
            raise NoBaseline(f"the reference runs compare against BASELINE {BASELINE}, a commit this clone "
                             f"lacks (git archive: {said}); fetch the history with `git fetch --unshallow` "
                             f"(or `git fetch origin {BASELINE}`) and rerun")
        os.makedirs(tree)
        subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
    return tree


def baseline_rows(name, out, steps=None):
    """The metrics of BASELINE's trainer on run `name`, on the warm start under out: the recording where this
    machine has one, else a run of BASELINE's trainer beside it (out/baseline/<name>)."""
    path = golden(name, out)
    if os.path.exists(path):
        return [json.loads(line) for line in open(path)][:steps]
    where, model = os.path.join(out, "baseline"), f"model_{RUNS[name][0]}"
    os.makedirs(where, exist_ok=True)
    if not os.path.exists(os.path.join(where, model)):  # the same warm start: the one this tree's toy built
        os.symlink(os.path.join(out, model), os.path.join(where, model))
    return [comparable(r) for r in run(name, where, steps, baseline_tree(out))]


if __name__ == "__main__":
    import torch
    torch.set_num_threads(1)
    if sys.argv[1] == "--write":
        os.makedirs(GOLDEN, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            try:
                root = baseline_tree(tmp)
            except NoBaseline as e:
                sys.exit(str(e))
            for name in sys.argv[2:] or RUNS:
                rows = run(name, tmp, root=root)
                with open(golden(name, tmp), "w") as f:
                    f.writelines(json.dumps(comparable(r)) + "\n" for r in rows)
    else:
        for spec in sys.argv[2:] or RUNS:
            name, _, steps = spec.partition(":")
            run(name, sys.argv[1], int(steps) if steps else None)
