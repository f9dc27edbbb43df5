"""Reference runs: fixed-seed training runs whose metrics a change that means to alter nothing must leave equal.

    python tests/reference.py --write            # record tests/data/reference/<run>.jsonl (before a refactor)
    python tests/reference.py OUT [RUN[:STEPS] ...]   # rerun into OUT, all or the first STEPS steps

Runs: the toy (its warm start, then 40 steps of STAPO) on one rank, on two, and in one micro-batch, and 3
steps through vLLM's CPU build on two ranks. Each is a subprocess with one thread, so the float order is
the same every time. The learning rate is constant (no warm-up), so a shorter run's steps are the first steps
of the recorded one: tests/test_reference.py reruns a prefix of each to keep CI short.

The numbers hold for one machine's float kernels: another CPU (another vendor's BLAS path, another vector
width) warm-starts the toy to other weights, and every sampled token after that differs. So each recording
is named for the warm start it began from, <run>-<id>.jsonl with id a hash of the warm-started weights, and
a machine whose warm start has no recording has nothing to compare against (record one there, on a commit
known to be good).
"""
import hashlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "data", "reference")
sys.path.insert(0, os.path.join(ROOT, "examples"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
# What varies from run to run by nature: time and memory
VARYING = {"rollout_s", "train_s", "step_s", "tokens_per_s"}


def toy_model(d, hidden=64):
    """The toy's tokenizer and model, warm-started (its own fixed seeds), and its training problems."""
    import toy
    os.makedirs(d, exist_ok=True)
    tok = toy.build_tokenizer(os.path.join(d, "model"))
    train = toy.problems()[0]
    model = toy.warm_start(toy.build_model(os.path.join(d, "model"), tok, hidden=hidden), tok, train, steps=120)
    model.save_pretrained(os.path.join(d, "model"))
    with open(os.path.join(d, "train.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in train)


def flags(d, out, steps, *extra):
    return ["--model", os.path.join(d, "model"), "--dataset", os.path.join(d, "train.jsonl"), "--out", out,
            "--steps", str(steps), "--prompts-per-step", "16", "--group-size", "8", "--minibatches", "2",
            "--micro-tokens", "256", "--max-prompt-len", "64", "--max-response-len", "8", "--lr", "5e-4",
            "--warmup-steps", "0", "--weight-decay", "0", "--save-every", "0", "--tau-p", "0.05",
            "--log-silenced", "--seed", "0", *extra]


def train(argv, nproc):
    launch = [sys.executable] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    r = subprocess.run(launch + [os.path.join(ROOT, "stapo.py"), *argv], capture_output=True, text=True,
                       cwd=ROOT, env=ENV, timeout=900)
    if r.returncode:
        raise RuntimeError(r.stderr[-4000:])


RUNS = {  # name: (model's hidden size, steps, ranks, extra flags)
    "toy_1rank": (64, 40, 1, ()),
    "toy_2ranks": (64, 40, 2, ()),
    "toy_one_micro_batch": (64, 40, 1, ("--micro-tokens", "4096")),
    "vllm_2ranks": (128, 3, 2, ("--engine", "vllm", "--tau-p", "0.5")),
}


def run(name, out, steps=None):
    """One reference run into out/<name>, all its steps or the first `steps`; returns its metrics rows.
    Runs with the same hidden size share one warm-started model under out."""
    hidden, all_steps, nproc, extra = RUNS[name]
    steps = steps or all_steps
    model = os.path.join(out, f"model_{hidden}")
    if not os.path.exists(os.path.join(model, "train.jsonl")):
        toy_model(model, hidden)
    train(flags(model, os.path.join(out, name), steps, *extra), nproc)
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
    return {k: v for k, v in row.items() if k not in VARYING and not k.startswith("peak_gb/")}


if __name__ == "__main__":
    import torch
    torch.set_num_threads(1)
    if sys.argv[1] == "--write":
        import tempfile
        os.makedirs(GOLDEN, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            for name in sys.argv[2:] or RUNS:
                rows = run(name, tmp)
                with open(golden(name, tmp), "w") as f:
                    f.writelines(json.dumps(comparable(r)) + "\n" for r in rows)
    else:
        for spec in sys.argv[2:] or RUNS:
            name, _, steps = spec.partition(":")
            run(name, sys.argv[1], int(steps) if steps else None)
