"""What several test files need, in one place: the tiny runs' flags and their outputs read back, model
and metric comparisons, launching stapo.py and torchrun, an engine that returns fixed samples, and
dispatch modes that count matmuls and host reads."""
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import parallel
import problems
import stapo
from rollout import HFEngine


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(ROOT, "..", "shared", "data")
PROBE = [5, 6, 7, 8, 9]


def args_for(tiny_dir, out, *extra):
    return ["--model", str(tiny_dir / "model"), "--dataset", str(tiny_dir / "train.jsonl"), "--out", str(out),
            "--prompts-per-step", "4", "--group-size", "4", "--minibatches", "2", "--micro-tokens", "256",
            "--max-prompt-len", "64", "--max-response-len", "6", "--lr", "1e-3", "--warmup-steps", "2",
            "--save-every", "0", "--tau-p", "0.2", *extra]


def load_params(path):
    from transformers import AutoModelForCausalLM
    return {k: v.detach().clone() for k, v in AutoModelForCausalLM.from_pretrained(path).state_dict().items()}


def assert_same_params(a, b, atol=2e-5):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=1e-4), (k, (a[k] - b[k]).abs().max())


def run(argv, nproc=1):
    cmd = [sys.executable, os.path.join(ROOT, "stapo.py"), *argv] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
         os.path.join(ROOT, "stapo.py"), *argv]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r


TIMING = {"rollout_s", "train_s", "step_s", "tokens_per_s"}  # what varies by nature, with the peaks


def assert_same_metrics(a, b, rel=1e-4):
    """Every metric but the timings and the memory peaks, step by step, to float precision."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in {k for k in x if k not in TIMING and not k.startswith(("peak_gb/", "seconds/"))}:
            values = zip(x[k], y[k]) if isinstance(x[k], list) and len(x[k]) == len(y[k]) else [(x[k], y[k])]
            for u, v in values:  # a list (lm_head_grad_norm: one per update) value by value
                if isinstance(u, float) and isinstance(v, float):
                    assert math.isclose(u, v, rel_tol=rel, abs_tol=1e-6), (x["step"], k, x[k], y[k])
                else:
                    assert u == v, (x["step"], k, x[k], y[k])


def metrics_of(out):
    return [json.loads(x) for x in open(out / "metrics.jsonl")]


def torchrun(argv, nproc, log, *launcher):
    """stapo.py under torchrun as docs/training.md launches it, not waited for: in a session of its own (a signal
    to the tests' group does not reach it), its output in the file `log`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *launcher,
           os.path.join(ROOT, "stapo.py"), *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True, env=env)


def wait_for_steps(out, n, agent, polls=3000):
    """Until metrics.jsonl logs n steps (the run still going), polling every 0.1 s: a hang gives up after
    `polls` looks, a bound on waiting, not a speed the test asks for."""
    for _ in range(polls):
        if os.path.exists(out / "metrics.jsonl") and len(metrics_of(out)) >= n:
            return
        assert agent.poll() is None, f"no step {n} in {out} (exit {agent.poll()})"
        time.sleep(0.1)
    pytest.fail(f"no step {n} in {out} after {polls} polls")


def finish(agent, timeout=300):
    """The launcher's exit code; on a hang or a failed assertion, the whole group is killed."""
    try:
        return agent.wait(timeout=timeout)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)


def tree_hashes(folder):
    """Every file under folder, by its path, with its contents' hash."""
    files = [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names]
    return {os.path.relpath(f, folder): hashlib.sha256(open(f, "rb").read()).hexdigest() for f in files}


class FixedEngine(HFEngine):
    """Returns the samples it is given, whatever it is asked: for degenerate-batch tests. Its weights
    (for the sync's self-check) are a real HF copy."""

    def __init__(self, groups, model_path, tok):
        super().__init__(model_path, torch.device("cpu"), torch.float32, tok.eos_token_id)
        self.groups, self.synced = groups, 0

    def generate(self, prompts, n, temperature, top_p, max_tokens, seeds, progress=False):
        assert len(prompts) == len(self.groups) and all(len(g) == n for g in self.groups)
        return self.groups

    def load_weights(self, named):
        named = list(named)
        self.synced += len(named)
        super().load_weights(named)


def one_step_on_four_prompts(tiny, tmp_path, *flags):
    """What train_step needs on the tiny model's first 4 problems, step 0 at full lr: (args, policy, opt,
    device, the problems, their prompts, and ids(text): a response's token ids)."""
    d, tok = tiny
    args = stapo.get_args(args_for(d, tmp_path, "--warmup-steps", "0", *flags))
    rank, world, device, mesh = parallel.init_distributed()
    policy = stapo.build_policy(args.model, mesh, device)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    data = problems.load_problems(args.dataset)[:4]
    prompts = [(i, problems.encode_prompt(tok, p), a) for i, (p, a) in enumerate(data)]
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # noqa: E731
    return args, policy, opt, device, data, prompts, ids


class Matmuls(TorchDispatchMode):
    """Counts the matmuls (mm, addmm, bmm) dispatched while it is on."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ in ("mm", "addmm", "bmm")
        return func(*args, **(kwargs or {}))


class HostReads(TorchDispatchMode):
    """The aten calls that make a GPU wait for the host, while `on`: a read of a tensor (.item(), float(),
    bool(): _local_scalar_dense, is_nonzero) and, unless data_sized=False, the calls whose output size is data
    (nonzero, masked_select, an index or index_put by a boolean mask)."""
    READS = {"_local_scalar_dense", "is_nonzero"}
    DATA_SIZED = {"nonzero", "masked_select", "_unique2", "unique_consecutive"}

    def __init__(self, data_sized=True):
        super().__init__()
        self.seen, self.on, self.data_sized = [], True, data_sized

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        masks = name in ("index", "index_put", "index_put_") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in args[1])
        if self.on and (name in self.READS or self.data_sized and (name in self.DATA_SIZED or masks)):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))

    def off_after(self, fn):
        def stop(*a, **k):
            self.on = False
            return fn(*a, **k)
        return stop

    def off_during(self, fn):
        def quiet(*a, **k):
            self.on = False
            try:
                return fn(*a, **k)
            finally:
                self.on = True
        return quiet


def host_reads(fn, *args, data_sized=True):
    """fn(*args), and how many host reads (HostReads) its aten calls made."""
    with HostReads(data_sized) as reads:
        out = fn(*args)
    return out, len(reads.seen)


def load_script(path):
    """A script of the repository (benchmarks/x.py, examples/y.py) imported as a module, by its path from the
    root: its functions to call, its __main__ block not run."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0],
                                                  os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
