"""The trainer on a tiny offline Qwen3: objectives, distribution invariance, resume, degenerate batches, data."""
import contextlib
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import checkpoint
import eval as ev
import rollout
import problems
import parallel
import metrics
import stapo
import analysis
import layers
import policy as policies
from rollout import HFEngine, Sample

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


# ---- distribution, micro-batching, resume -------------------------------------------------------------

TIMING = {"rollout_s", "train_s", "step_s", "tokens_per_s"}


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


@pytest.fixture
def one_thread():
    """In-process runs on one thread, as the subprocess runs (OMP_NUM_THREADS=1): the same float order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_two_ranks_and_other_micro_batches_equal_one_process(tiny, tmp_path, one_thread):
    """With silencing active (tau_p 0.9) and micro-batches of 64 tokens (the ranks run unequal numbers
    of them), two ranks give the model and every metric of one process; so does one micro-batch per
    mini-batch ("big": the S2T pass is the update's own forward, and mini-batch 0's old log p comes from
    it). A per-rank tau_h, a per-rank denominator, a count summed over ranks twice, or a fused pass that
    leaves mini-batch 0's old log p unset or computes the mask from other values breaks this."""
    d, _ = tiny
    common = ("--steps", "3", "--tau-p", "0.99", "--micro-tokens", "64")  # S2T silences on any CPU kernels
    stapo.train(stapo.get_args(args_for(d, tmp_path / "one", *common)))
    run(args_for(d, tmp_path / "two", *common), nproc=2)
    stapo.train(stapo.get_args(args_for(d, tmp_path / "big", *common[:4], "--micro-tokens", "512")))
    one = load_params(tmp_path / "one" / "model")
    assert_same_params(one, load_params(tmp_path / "two" / "model"))
    assert_same_params(one, load_params(tmp_path / "big" / "model"))
    assert not torch.allclose(one["lm_head.weight"], load_params(d / "model")["lm_head.weight"])  # it trained
    m1 = metrics_of(tmp_path / "one")
    assert sum(x["silenced_frac"] > 0 for x in m1) >= 2 and all(x["candidates"] > 0 for x in m1)  # S2T at work
    assert_same_metrics(m1, metrics_of(tmp_path / "two"))
    assert_same_metrics(m1, metrics_of(tmp_path / "big"))


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


@pytest.mark.slow
def test_sigterm_to_torchrun_checkpoints_the_step_reached_and_resume_equals_uninterrupted(tiny, tmp_path, one_thread):
    """SIGTERM to the torchrun agent as 2 ranks train, with no --save-every checkpoint due: every rank finishes
    its step, saves it and exits non-zero, saying how to resume. --resume on 1 rank then reaches the model and
    every metric of an uninterrupted run, each step logged once. Caught: a handler that exits at once (no
    checkpoint), one that ignores the signal (the run ends), a checkpoint of another step than the last logged,
    a rank that saves a different step or none (the resume fails or differs)."""
    d, _ = tiny
    common = ("--tau-p", "0.9", "--steps", "4")
    stapo.train(stapo.get_args(args_for(d, tmp_path / "full", *common)))
    cut = tmp_path / "cut"
    with open(tmp_path / "cut.log", "w") as log:
        agent = torchrun(args_for(d, cut, *common), 2, log, "--shutdown-timeout", "120")
        try:
            wait_for_steps(cut, 1, agent)
            os.kill(agent.pid, signal.SIGTERM)
        finally:
            code = finish(agent)
    out = open(tmp_path / "cut.log").read()
    reached = len(metrics_of(cut))
    assert code != 0 and 1 <= reached < 4, out[-3000:]
    assert sorted(os.listdir(cut / "ckpt")) == [f"step_{reached}"], out[-3000:]
    assert json.load(open(cut / "ckpt" / f"step_{reached}" / "state.json")) == {"step": reached,
                                                                                "data_position": 4 * reached}
    assert f"stopped by a signal after step {reached}" in out and "the same command with --resume" in out
    stapo.train(stapo.get_args(args_for(d, cut, *common, "--resume")))
    assert_same_params(load_params(tmp_path / "full" / "model"), load_params(cut / "model"))
    assert [x["step"] for x in metrics_of(cut)] == [1, 2, 3, 4]
    assert_same_metrics(metrics_of(tmp_path / "full"), metrics_of(cut))


@pytest.mark.slow
def test_a_rank_killed_under_max_restarts_is_restarted_and_every_step_is_logged_once(tiny, tmp_path):
    """The elastic pattern, torchrun --max-restarts 1 ... --resume: the first launch finds no checkpoint and
    starts fresh; local rank 1 is SIGKILLed after step 3, the agent restarts both ranks, they resume from step 2's
    checkpoint and finish, each step logged once. Caught: --resume refusing an empty --out, a restart refused
    as a used --out, step 3 logged twice, a surviving rank that hangs the restart."""
    d, _ = tiny
    out = tmp_path / "run"
    with open(tmp_path / "run.log", "w") as log:
        agent = torchrun(args_for(d, out, "--steps", "5", "--save-every", "2", "--resume"), 2, log, "--max-restarts",
                         "1")
        try:
            wait_for_steps(out, 3, agent)
            workers = open(f"/proc/{agent.pid}/task/{agent.pid}/children").read().split()
            rank_1 = [pid for pid in workers if b"LOCAL_RANK=1\0" in open(f"/proc/{pid}/environ", "rb").read()]
            os.kill(int(rank_1[0]), signal.SIGKILL)
        finally:
            code = finish(agent)
    assert code == 0, open(tmp_path / "run.log").read()[-3000:]
    assert [x["step"] for x in metrics_of(out)] == [1, 2, 3, 4, 5]
    assert sorted(os.listdir(out / "ckpt")) == ["step_2", "step_4"] and os.path.isdir(out / "model")


def test_restarts_on_the_agents_shared_store_are_refused(monkeypatch):
    """torchrun --max-restarts with the agent's store shared (torch 2.13's default) stops every rank at its start,
    naming the setting that makes restarts safe; without restarts, or with a store per attempt, nothing is
    refused. Caught: a launch whose first restart would hang (docs/training.md: elastic restarts)."""
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(RuntimeError, match="--max-restarts 3: launch it with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        parallel.refuse_restarts_on_the_agents_store()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives
    parallel.refuse_restarts_on_the_agents_store()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    parallel.refuse_restarts_on_the_agents_store()


def tree_hashes(folder):
    """Every file under folder, by its path, with its contents' hash."""
    files = [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names]
    return {os.path.relpath(f, folder): hashlib.sha256(open(f, "rb").read()).hexdigest() for f in files}


def test_a_used_out_is_refused_without_resume_and_left_as_it_was(tiny, tmp_path):
    """A second run into a used --out without --resume stops before it writes anything, saying what the folder
    holds and the two ways on; so does eval.py into a used --out. Caught: a run that starts over from step 0
    (metrics.jsonl, the checkpoint and the model rewritten), a refusal after --out's .run_token or config.json
    is written, an eval that overwrites samples.jsonl."""
    d, _ = tiny
    stapo.train(stapo.get_args(args_for(d, tmp_path / "a", "--steps", "1", "--save-every", "1")))
    before = tree_hashes(tmp_path / "a")
    with pytest.raises(parallel.UserError, match=r"already holds a run: metrics.jsonl logged to step 1, the checkpoint "
                                              r"ckpt/step_1, a trained model in model/\. Continue it with --resume, or "
                                              r"start anew in another --out"):
        stapo.train(stapo.get_args(args_for(d, tmp_path / "a", "--steps", "2")))
    assert tree_hashes(tmp_path / "a") == before and ".run_token" in before
    record = {"benchmark": "math500", "id": "0", "correct": True, "length": 3, "finish_reason": "stop"}
    ev.write_results(str(tmp_path / "e"), [record], {"model": "m"})
    before = tree_hashes(tmp_path / "e")
    with pytest.raises(parallel.UserError, match=r"holds an evaluation in samples.jsonl\. Write this evaluation to "
                                              r"another --out; to judge that one's samples: --judge-only"):
        ev.main(["--model", str(d / "model"), "--benchmarks", "math500", "--out", str(tmp_path / "e")])
    assert tree_hashes(tmp_path / "e") == before


SECOND_SIGNAL = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from checkpoint import StopAtStepEnd
with StopAtStepEnd("unused") as stop:
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # the same stop twice at once: a scheduler's, and the agent's copy
    print("noted", stop.got, flush=True)
    time.sleep(2.5)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(10)
print("not stopped", flush=True)
"""


def test_a_second_signal_stops_at_once_and_the_same_one_twice_does_not():
    """The first SIGTERM is noted (the run goes on to its step's end), and so is a copy of it at once; a second
    signal later kills the process at once. Caught: a handler that exits on the first signal, one that counts
    the agent's forwarded copy as a second, one that swallows the second."""
    r = subprocess.run([sys.executable, "-c", SECOND_SIGNAL, ROOT], capture_output=True, text=True, timeout=120)
    assert r.stdout == "noted SIGTERM\n" and r.returncode == -signal.SIGINT, (r.returncode, r.stdout, r.stderr)


def test_a_crash_mid_save_keeps_the_previous_checkpoint(tiny, tmp_path, monkeypatch):
    """Killed while writing step 4's checkpoint: step 2's is intact, and --resume from it reaches the
    uninterrupted run's model. Checkpoints beyond --keep-ckpts are removed, oldest first."""
    d, _ = tiny
    stapo.train(stapo.get_args(args_for(d, tmp_path / "full", "--steps", "4")))
    real_save_hf = checkpoint.save_hf

    def dies_in_step_4(policy, tok, path, rank):
        if "step_4" in path:
            raise KeyboardInterrupt("killed mid-save")
        real_save_hf(policy, tok, path, rank)
    monkeypatch.setattr(checkpoint, "save_hf", dies_in_step_4)
    with pytest.raises(KeyboardInterrupt):
        stapo.train(stapo.get_args(args_for(d, tmp_path / "cut", "--steps", "4", "--save-every", "2")))
    assert sorted(os.listdir(tmp_path / "cut" / "ckpt")) == ["step_2", "step_4.tmp"]
    monkeypatch.setattr(checkpoint, "save_hf", real_save_hf)
    stapo.train(stapo.get_args(args_for(d, tmp_path / "cut", "--steps", "4", "--save-every", "2", "--keep-ckpts", "1",
                                        "--resume")))
    assert sorted(os.listdir(tmp_path / "cut" / "ckpt")) == ["step_4"]
    assert_same_params(load_params(tmp_path / "full" / "model"), load_params(tmp_path / "cut" / "model"))
    assert [x["step"] for x in metrics_of(tmp_path / "cut")] == [1, 2, 3, 4]


def test_outputs_config_metrics_and_silenced_log(tiny, tmp_path, monkeypatch):
    """The run's files and keys; on every mini-batch of the run the taxonomy's spurious group is the set S2T
    silenced (breaks with another entropy cut than S2T's tau_h); the silenced tokens' applied share of the
    gradient is 0 and their share if kept is logged beside it (breaks with the unclipped, unsilenced weight)."""
    d, _ = tiny
    real_split, split = analysis.TokenAnalysis.split, []

    def checked(self, silenced, candidates, tau_h, entropy, low_p, adv, valid, tokens):
        if tau_h is not None:
            groups = analysis.token_groups(low_p, adv, entropy, valid, tau_h)
            split.append(torch.equal(groups[analysis.SPURIOUS], silenced))
        return real_split(self, silenced, candidates, tau_h, entropy, low_p, adv, valid, tokens)
    monkeypatch.setattr(analysis.TokenAnalysis, "split", checked)
    stapo.train(stapo.get_args(args_for(d, tmp_path, "--steps", "2", "--log-silenced", "--tau-p", "0.99",
                                        "--analysis")))
    assert split and all(split)
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["method"] == "stapo" and cfg["tau_p"] == 0.99 and cfg["world_size"] == 1
    m = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    need = {"reward_mean", "accuracy", "zero_variance_groups", "response_len_mean", "response_len_max", "truncated",
            "entropy_mean", "silenced_frac", "candidates", "tau_h", "clip_low", "clip_high", "grad_norm", "lr",
            "rollout_s", "train_s", "step_s", "tokens_per_s", "sync_probe_gap", "sync_probe_gap_mean",
            "taxonomy/split", "grad_share/silenced_if_kept", *[f"grad_share/{k}" for k in analysis.SHARES],
            *[f"taxonomy/{g}/{k}" for g in analysis.GROUPS for k in ("tokens", "grad_norm", "dH", "entropy")],
            "s2t_later/tokens", "s2t_later/logp_then", "s2t_later/logp_now", "s2t_later/rose",
            *[f"seconds/{phase}" for phase in ("rollout", "old_policy", "forward", "backward", "optimizer", "sync")]}
    assert need <= m[0].keys() and not any(k.startswith("rollout_is") for k in m[0])  # off by default
    # tau_p = 0.99 makes most tokens candidates, and S2T silences some on any CPU's kernels (at 0.9, none in
    # step 1 with ATEN_CPU_CAPABILITY=default)
    assert m[0]["silenced_frac"] > 0 and m[0]["candidates"] > 0
    for x in m:  # the token analysis: shares of the gradient, and of the split tokens, each summing to one
        assert sum(x[f"grad_share/{k}"] for k in analysis.SHARES) == pytest.approx(1)
        assert x["taxonomy/split"] > 0 and sum(x[f"taxonomy/{g}/tokens"] for g in analysis.GROUPS) == pytest.approx(1)
        assert x["grad_share/silenced"] == 0 and (x["grad_share/silenced_if_kept"] > 0) == (x["silenced_frac"] > 0)
        assert (x[f"taxonomy/{analysis.SPURIOUS}/tokens"] > 0) == (x["silenced_frac"] > 0)
    sil = [json.loads(x) for x in open(tmp_path / "silenced.jsonl")]
    assert {"step", "token", "t", "p", "H", "silenced", "left", "right"} == sil[0].keys()
    assert all(x["silenced"] for x in sil)  # under stapo; under the others S2T's set is logged, kept
    for step in (1, 2):  # one line per silenced token: silenced_frac * the step's 16 samples' valid tokens
        n_valid = m[step - 1]["response_len_mean"] * 16
        assert sum(x["step"] == step for x in sil) == round(m[step - 1]["silenced_frac"] * n_valid)
    assert all(x["p"] < 0.99 for x in sil)
    assert all(len(x["left"]) <= 40 and len(x["right"]) <= 40 for x in sil)


def test_s2t_set_is_revisited_at_its_context_a_few_steps_on(tiny, tmp_path):
    """--analysis keeps a sample of each step's S2T set and, analysis.Later's 5 steps on, reads its log p at the
    same context under the policy then: at lr 0 (the policy never moves) that is the log p it had, token for
    token within float noise, and under every objective (JustRL here). Breaks if the revisit reads another
    position than the token's (its context one token short or long), another row, or another step's sample."""
    d, _ = tiny
    stapo.train(stapo.get_args(args_for(d, tmp_path, "--steps", "7", "--tau-p", "0.99", "--analysis", "--lr", "0",
                                        "--method", "justrl")))
    m = metrics_of(tmp_path)
    assert [x["s2t_later/tokens"] for x in m[:5]] == [0] * 5 and all(x["s2t_later/tokens"] > 0 for x in m[5:])
    for x in m[5:]:
        assert x["s2t_later/logp_now"] == pytest.approx(x["s2t_later/logp_then"], abs=1e-5), x
        assert x["s2t_later/logp_then"] < math.log(0.99)


def test_report_to_sends_every_steps_numbers_and_is_imported_only_when_asked(tiny, tmp_path, monkeypatch):
    """--report-to wandb / tensorboard gets each step's numeric metrics at that step (what metrics.jsonl
    holds); without the flag neither package is imported, so a run never needs them."""
    d, _ = tiny
    sent, inits = [], []
    run = types.SimpleNamespace(log=lambda numbers, step: sent.append((step, numbers)))
    wandb = types.SimpleNamespace(init=lambda **kw: inits.append(kw) or run)

    class SummaryWriter:
        def __init__(self, path):
            self.path = path

        def add_scalar(self, key, value, step):
            if not sent or sent[-1][0] != step:
                sent.append((step, {}))
            sent[-1][1][key] = value

        def flush(self):
            pass
    tensorboard = types.SimpleNamespace(SummaryWriter=SummaryWriter)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tensorboard)
    for kind in ("wandb", "tensorboard"):
        sent.clear()
        stapo.train(stapo.get_args(args_for(d, tmp_path / kind, "--steps", "2", "--report-to", kind)))
        numbers = [(m["step"], {k: v for k, v in m.items() if isinstance(v, (int, float))})
                   for m in metrics_of(tmp_path / kind)]
        assert sent == numbers and len(sent) == 2 and "accuracy" in sent[0][1]
    # W&B: a project, the run named for --out; --resume continues the same W&B run (its id kept in --out)
    stapo.train(stapo.get_args(args_for(d, tmp_path / "wandb", "--steps", "3", "--report-to", "wandb",
                                        "--resume")))
    assert [kw["id"] for kw in inits] == [inits[0]["id"]] * 2 and inits[0]["name"] == "wandb"
    assert inits[0]["project"] and inits[1]["resume"] == "allow"
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it now raises ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    metrics.Reporter("none", str(tmp_path), {}).log({"step": 1, "accuracy": 0.5})
    for kind, package in (("wandb", "wandb"), ("tensorboard", "tensorboard")):  # one line, before any model
        with pytest.raises(parallel.UserError, match=f"--report-to {kind} needs the {package} package: pip install"):
            stapo.train(stapo.get_args(args_for(d, tmp_path / f"no_{kind}", "--report-to", kind)))
        assert not (tmp_path / f"no_{kind}").exists()


# ---- the HF engine's sampler ----------------------------------------------------------------------------

def test_sample_token_is_the_inverse_cdf_by_hand():
    """p = [.5, .3, .2] (logits shifted by 3: the CDF is scaled by its total). u below .5 draws token 0,
    below .8 token 1, then 2; temperature .5 gives p ~ p^2 = [.658, .237, .105]; top_p .7 keeps tokens 0
    and 1 ([.625, .375]); temperature 0 is the argmax. An off-by-one at a boundary, an unscaled CDF or a
    temperature applied twice moves one of these."""
    logits = torch.tensor([0.5, 0.3, 0.2]).log() + 3.0
    draw = lambda us, t=1.0, top_p=1.0: rollout.sample_token(  # noqa: E731
        logits.expand(len(us), 3), torch.tensor(us, dtype=torch.float64), t, top_p).tolist()
    assert draw([0.0, 0.4999, 0.5001, 0.7999, 0.8001, 0.99999]) == [0, 0, 1, 1, 2, 2]
    assert draw([0.65, 0.66, 0.89, 0.9], t=0.5) == [0, 1, 1, 2]
    assert draw([0.6, 0.63, 0.99999], top_p=0.7) == [0, 1, 1]
    assert draw([0.99999, 0.0], t=0) == [0, 0]


def test_sample_token_draws_a_one_in_a_trillion_token_at_its_rate():
    """p1 = 1e-12: it is drawn for u in [1 - 1e-12, 1) and only there. A float32 CDF rounds it away."""
    logits = torch.tensor([[0.0, math.log(1e-12)]]).expand(3, 2)
    u = torch.tensor([1 - 0.5e-12, 1 - 2e-12, 0.5], dtype=torch.float64)
    assert rollout.sample_token(logits, u, 1.0).tolist() == [1, 0, 0]


def test_hf_engine_samples_do_not_depend_on_the_batch_and_match_the_model(tiny):
    """A prompt's samples are the same alone and beside a longer prompt (it is then left-padded: a pad
    that is attended changes them); greedy decoding equals HF `generate`'s; and a token's frequencies
    over 600 samples match the model's softmax."""
    d, tok = tiny
    engine = HFEngine(str(d / "model"), torch.device("cpu"), torch.float32, tok.eos_token_id)
    short, long = problems.encode_prompt(tok, "What is 1 + 2?"), problems.encode_prompt(tok, "What is 3 + 4? " * 3)
    alone = engine.generate([short], 3, 1.0, 1.0, 8, [11])[0]
    beside = engine.generate([long, short], 3, 1.0, 1.0, 8, [5, 11])[1]
    assert [s.tokens for s in alone] == [s.tokens for s in beside]
    for prompt in (short, long):
        (greedy,) = engine.generate([prompt], 1, 0.0, 1.0, 8, [0])[0]
        ids = torch.tensor([prompt])
        want = engine.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                     do_sample=False)[0, len(prompt):].tolist()
        assert greedy.tokens == want[:len(greedy.tokens)]
    boxed = short + tok("\\boxed{", add_special_tokens=False)["input_ids"]  # the digit after it is uncertain
    first = [s.tokens[0] for s in engine.generate([boxed], 600, 1.0, 1.0, 1, [3])[0]]
    with torch.no_grad():
        p = engine.model(torch.tensor([boxed])).logits[0, -1].softmax(-1)
    assert p.max() < 0.5  # spread out: a sampler at the wrong temperature shows
    freq = torch.bincount(torch.tensor(first), minlength=len(p)) / 600
    assert 0.5 * (freq - p).abs().sum() < 0.07  # total variation 0.041; at temperature 0.7 it is 0.11


# ---- one step on controlled samples ---------------------------------------------------------------------

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


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_policys_forward_is_the_models_log_softmax(tiny, attention):
    """policy.response_logprobs of right-padded samples of unequal lengths equals log_softmax of the model's
    own logits (transformers' forward, one sample at a time, unpadded) at each response token, zero after it:
    with sdpa the masks are handed over as None (the kernel masks causally), with eager attention transformers
    builds them. Breaks if a pad or a later token reaches a real one (a mask dropped where the kernel does not
    mask causally) or if a gather's index is off by one."""
    from transformers import AutoModelForCausalLM
    d, tok = tiny
    lm = AutoModelForCausalLM.from_pretrained(str(d / "model"), attn_implementation=attention)
    policy = policies.Policy(lm, layers.run_through(lm))
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(100, (p,), generator=g).tolist(), torch.randint(100, (r,), generator=g).tolist())
            for p, r in ((3, 4), (5, 1), (2, 7), (4, 0))]
    valid = torch.arange(9) < torch.tensor([len(r) for _, r in rows])[:, None]
    with torch.no_grad():
        got = policies.response_logprobs(policy, rows, [1, 3, 0, 2], valid, 1.0)
        for k, i in enumerate([1, 3, 0, 2]):
            prompt, response = rows[i]
            logits = lm(input_ids=torch.tensor([prompt + response])).logits[0].log_softmax(-1)
            want = logits[len(prompt) - 1:-1].gather(-1, torch.tensor(response, dtype=torch.long)[:, None])[:, 0]
            assert torch.allclose(got.logp[k, :len(response)], want, atol=1e-5), (attention, i)
            assert not got.logp[k, len(response):].any() and not got.entropy[k, len(response):].any()
    assert (policy.masks is None) == (attention == "eager")


def test_compiled_layers_compute_what_the_eager_layers_do(tiny):
    """layers.compile_layers (stapo.py --compile-layers; auto: on CUDA) against the eager layers, on the same
    weights and samples: log p of every response token and every parameter's gradient, over two micro-batches
    of different shapes (the dynamic-shape graph), with FSDP2 and checkpointing as the trainer builds them.
    On a GPU (benchmarks/gpu_check.sh runs this test there) the backend is inductor, in fp32 and bf16; on CPU,
    aot_eager in fp32: dynamo's capture, the FSDP2 hooks it skips and AOT autograd are ours to prove, while
    inductor's CPU kernels, which no GPU runs, cost a minute of compiling. Tolerances, the largest gap over
    log p and gradients against the fp32 eager result: fp32, 1e-5 of the largest value (reordered sums);
    bf16, at most twice the bf16 eager layers' own gap (a fused chain kept in fp32 is closer to fp32).
    Breaks if compile_layers compiles nothing (no graph), renames the parameters (torch.compile(layer) wraps
    it: _orig_mod., which checkpoints and syncs would not find), or computes something else."""
    from torch._dynamo.utils import counters
    d, _ = tiny
    rank, world, device, mesh = parallel.init_distributed()
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(100, (p,), generator=g).tolist(), torch.randint(100, (r,), generator=g).tolist())
            for p, r in ((3, 4), (5, 2), (2, 7), (4, 3), (6, 9))]
    valid = (torch.arange(9) < torch.tensor([len(r) for _, r in rows])[:, None]).to(device)

    def run(policy):
        policy.zero_grad(set_to_none=True)
        out = []
        for idx in ([0, 1, 2], [3, 4]):  # [3, 9] then [2, 15]: a second shape
            logp = policies.response_logprobs(policy, rows, idx, valid, 1.0).logp
            (logp * valid[idx]).sum().backward()
            out.append(logp.detach().float().flatten())
        return torch.cat(out + [p.grad.full_tensor().float().flatten() for p in policy.parameters()])

    def both(dtype):  # (eager, compiled) on one policy
        policy = policies.build_policy(str(d / "model"), mesh, device, dtype)
        names, graphs = [n for n, _ in policy.named_parameters()], counters["stats"]["unique_graphs"]
        eager = run(policy)
        layers.compile_layers(policy.lm, policy.layers, backend)
        try:
            assert [n for n, _ in policy.named_parameters()] == names
            compiled = run(policy)
            assert counters["stats"]["unique_graphs"] > graphs  # something was compiled
        finally:
            layers.eager_layers(policy.lm, policy.layers)
        return eager, compiled

    try:
        ref, fp32 = both(torch.float32)
        gap = lambda x: (x - ref).abs().max().item() / ref.abs().max().item()  # noqa: E731
        print(f"compiled layers ({backend}): fp32, gap {gap(fp32):.2e} of the largest value")
        assert gap(fp32) <= 1e-5
        if device.type == "cuda":  # on CPU, aot_eager runs bf16 through the same aten ops as eager
            eager16, compiled16 = both(torch.bfloat16)
            print(f"bf16: gap {gap(compiled16):.2e}, the eager bf16 layers' {gap(eager16):.2e}")
            assert gap(compiled16) <= 2 * gap(eager16)
    finally:
        torch._dynamo.reset()


def layer_cache_entries():
    """The compiled variants the decoder layers hold: dynamo's cache entries on run_layer's code, which every
    layer shares, and which its recompile limit counts."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    return len(_debug_get_cache_entry_list(layers.run_layer.__code__))


def trainers_call_pattern(policy, opt, args, device, hidden, steps=3):
    """What stapo.py's steps ask of the policy, on made-up rows: the old pass (no grad) and the updates
    (forward, backward under checkpointing, a micro-batch of one sample among them) of two mini-batches of
    varied lengths, and the sync's probe (no grad, one row). Step 0's first micro-batch is one sample padded
    to exactly the hidden size (dynamo's duck sizing pins a length first compiled equal to another size)."""
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        rows = [(torch.randint(100, (p,), generator=g).tolist(), torch.randint(100, (r,), generator=g).tolist())
                for p, r in zip(torch.randint(5, 30, (16,), generator=g).tolist(),
                                torch.randint(1, 30, (16,), generator=g).tolist())]
        if step == 0:
            rows[0] = (rows[0][0][:5] + [1] * (hidden - 5 - 20), [2] * 20)  # 64 tokens: alone in its micro-batch
        lengths = torch.tensor([len(r) for _, r in rows])
        valid = (torch.arange(int(lengths.max())) < lengths[:, None]).to(device)
        blocks = [sorted(range(b * 8, b * 8 + 8), key=lambda i: len(rows[i][0]) + len(rows[i][1])) for b in (0, 1)]
        if step == 0:
            assert len(rows[blocks[0][-1]][0]) + len(rows[blocks[0][-1]][1]) <= hidden or blocks[0][0] == 0
        old = [stapo.token_stats(policy, rows, idx, valid, args.micro_tokens, 1.0) for idx in blocks]
        for idx, o in zip(blocks, old):
            adv = torch.linspace(-1, 1, len(idx), device=device)
            mb = stapo.MiniBatch(idx, o.logp, adv, valid[idx].float(), float(valid[idx].sum()))
            stapo.update(policy, opt, rows, valid, mb, args, metrics.StepMetrics(step, "stapo"))
        with torch.no_grad():
            probe = [(rows[0][0], rows[0][1] + rows[1][1])]
            policies.response_logprobs(policy, probe, [0], torch.ones(1, len(probe[0][1]), dtype=torch.bool), 1.0)


@pytest.mark.slow
def test_compiled_layers_stay_compiled_through_the_trainers_call_pattern(tiny, tmp_path):
    """Every decoder-layer call of three steps of the trainer's passes (trainers_call_pattern: the old pass,
    updates with their backward and checkpoint recompute, one-sample micro-batches, the probe, varied lengths,
    a first micro-batch padded to the hidden size) runs compiled: none is counted eager (run_layer counts the
    calls that run outside a compiled graph, as when dynamo's recompile limit is hit), and the variants the
    layers compile stay well under layers.RECOMPILE_LIMIT. Breaks if a variant of the pattern recompiles on
    every new length, or if the variants outgrow torch's default limit of 8 again (HF's checkpointing, a hook
    that makes layer 0's input require grad under no_grad, and the recompute's own entries made exactly 8)."""
    args, policy, opt, device, *_ = one_step_on_four_prompts(tiny, tmp_path, "--micro-tokens", "64")
    torch._dynamo.reset()
    layers.compile_layers(policy.lm, policy.layers, "aot_eager")  # AOT autograd, as inductor runs it, minus it
    try:
        before = policy.layers.eager_calls
        trainers_call_pattern(policy, opt, args, device, policy.lm.config.hidden_size)
        eager, variants = policy.layers.eager_calls - before, layer_cache_entries()
        print(f"compiled layers: {variants} variants over 3 steps; {eager} layer calls eager")
        assert eager == 0 and 0 < variants <= 4 < layers.RECOMPILE_LIMIT  # grad on, off; one sample, more
    finally:
        layers.eager_layers(policy.lm, policy.layers)
        torch._dynamo.reset()


@pytest.mark.slow
def test_layer_calls_that_run_eager_although_compiled_are_counted_and_said(tiny, tmp_path, monkeypatch, capsys):
    """A run whose compiled layers hit the recompile limit (1 here) counts each layer call that ran eager in its
    metrics row (eager_layer_calls) and says so in one line with the step; one whose compiler fails on every
    graph runs them eager, warns once naming --compile-layers off, trains on, and counts those calls too; a
    run of eager layers (--compile-layers off) has no such key. Breaks with a silent fallback (dynamo's own
    is one log line), a failed graph's calls left uncounted, or a count that a compiled call also moves."""
    d, _ = tiny
    real = layers.compile_layers
    torch._dynamo.reset()
    monkeypatch.setattr(policies, "compile_layers", lambda lm, runtime: real(lm, runtime, "aot_eager"))
    monkeypatch.setattr(layers, "RECOMPILE_LIMIT", 1)
    try:
        with torch._dynamo.config.patch(recompile_limit=1):  # (a monkeypatch of dynamo's config deletes it)
            stapo.train(stapo.get_args(args_for(d, tmp_path / "limit", "--steps", "2", "--compile-layers", "on")))
        rows = metrics_of(tmp_path / "limit")
        assert all(x["eager_layer_calls"] > 0 for x in rows), rows
        said = [line for line in capsys.readouterr().err.splitlines() if "decoder-layer calls ran eager" in line]
        assert len(said) == 2 and "step 1: " in said[0] and "--compile-layers off" in said[0]  # after tqdm's bar
        torch._dynamo.reset()
        monkeypatch.setattr(layers, "RECOMPILE_LIMIT", 64)

        def broken(graph, example_inputs):
            raise RuntimeError("no C++ compiler here")
        monkeypatch.setattr(policies, "compile_layers", lambda lm, runtime: real(lm, runtime, broken))
        with pytest.warns(UserWarning, match=r"torch.compile of a decoder layer failed.*no C\+\+ compiler here.*"
                                             r"--compile-layers off runs every layer eager") as caught:
            policy = stapo.train(stapo.get_args(args_for(d, tmp_path / "broken", "--steps", "2",
                                                         "--compile-layers", "on")))
        assert len([w for w in caught if "decoder layer" in str(w.message)]) == 1 and policy.layers.failures
        rows = metrics_of(tmp_path / "broken")
        assert all(x["grad_norm"] > 0 and x["eager_layer_calls"] > 0 for x in rows), rows
    finally:
        torch._dynamo.reset()
    stapo.train(stapo.get_args(args_for(d, tmp_path / "eager", "--steps", "1")))
    assert "eager_layer_calls" not in metrics_of(tmp_path / "eager")[0]


class Matmuls(TorchDispatchMode):
    """Counts the matmuls (mm, addmm, bmm) dispatched while it is on."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ in ("mm", "addmm", "bmm")
        return func(*args, **(kwargs or {}))


def test_a_failed_layer_compile_runs_eager_with_its_checkpoint_and_is_counted(tiny):
    """A compiler that fails on the layers' graph: the layers run eager from then on, each call counted in
    Layers.eager_calls, and their backward recomputes what full checkpointing dropped, as eager layers do (the
    same matmuls counted). Breaks if the fallback runs the traced graph instead (torch 2.11 runs that graph's
    checkpoint body without a checkpoint: the memory of --checkpointing off), or leaves its calls uncounted."""
    d, _ = tiny
    rank, world, device, mesh = parallel.init_distributed()
    rows = [([1, 2, 3], [4, 5, 6, 7]), ([1, 2], [3, 4])]
    valid = torch.arange(4) < torch.tensor([4, 2])[:, None]

    def backward_matmuls(policy):
        logp = policies.response_logprobs(policy, rows, [1, 0], valid, 1.0).logp
        with Matmuls() as seen:
            (logp * valid[[1, 0]]).sum().backward()
        return seen.count

    def broken(graph, example_inputs):
        raise RuntimeError("no C++ compiler here")
    eager = backward_matmuls(policies.build_policy(str(d / "model"), mesh, device))
    torch._dynamo.reset()
    try:
        policy = policies.build_policy(str(d / "model"), mesh, device)
        with pytest.warns(UserWarning, match="torch.compile of a decoder layer failed"):
            layers.compile_layers(policy.lm, policy.layers, broken)
            calls = policy.layers.eager_calls
            assert backward_matmuls(policy) == eager and policy.layers.failures
        assert policy.layers.eager_calls - calls == len(policy.lm.get_decoder().layers)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_checkpointing_full_selective_and_off_give_the_same_gradients(tiny, compiled):
    """--checkpointing full, selective and off: the same log p and every parameter's gradient, bit for bit, eager
    and compiled (aot_eager: the checkpoint inside the compiled graph, as inductor takes it; its selective
    policy then goes to AOT autograd's partitioner). What differs is what the backward recomputes, counted in
    its matmuls (eager): full replays the forward's, selective recomputes none (it keeps the matmuls' and
    attention's outputs), off has nothing to recompute. Breaks if a mode is dropped on its way to the layers,
    or if selective keeps nothing (it would recompute as full does)."""
    d, _ = tiny
    rank, world, device, mesh = parallel.init_distributed()
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(100, (p,), generator=g).tolist(), torch.randint(100, (r,), generator=g).tolist())
            for p, r in ((3, 4), (5, 2), (2, 7))]
    valid = torch.arange(7) < torch.tensor([len(r) for _, r in rows])[:, None]

    out = {}
    torch._dynamo.reset()
    try:
        for mode in ("full", "selective", "off"):
            policy = policies.build_policy(str(d / "model"), mesh, device, torch.float32, compiled, mode)
            if compiled:
                layers.compile_layers(policy.lm, policy.layers, "aot_eager")
            logp = policies.response_logprobs(policy, rows, [0, 1, 2], valid, 1.0).logp
            backward = Matmuls()
            with backward if not compiled else contextlib.nullcontext():  # a compiled backward is one graph
                (logp * valid).sum().backward()
            grads = [p.grad.full_tensor() for p in policy.parameters()]
            out[mode] = logp.detach(), grads, backward.count
    finally:
        torch._dynamo.reset()
    for mode in ("selective", "off"):
        assert torch.equal(out[mode][0], out["full"][0]), mode
        assert all(torch.equal(a, b) for a, b in zip(out[mode][1], out["full"][1])), mode
    if not compiled:
        assert out["selective"][2] == out["off"][2] < out["full"][2], {m: o[2] for m, o in out.items()}


@pytest.mark.parametrize("flags, want", [((), (False, "full")),
                                         (("--compile-layers", "on", "--no-checkpointing"), (True, "off")),
                                         (("--checkpointing", "selective"), (False, "selective"))])
def test_the_speed_flags_reach_the_policy(tiny, tmp_path, monkeypatch, flags, want):
    """--compile-layers (auto: on CUDA only, so off here) and --checkpointing (--no-checkpointing: off) reach
    policy.build_policy as (compiled, checkpointing). Breaks if either flag is dropped on its way, or if auto
    compiles on a CPU."""
    class Built(Exception):
        pass

    def build(path, mesh, device, dtype, compiled, checkpointing):
        raise Built(compiled, checkpointing)
    monkeypatch.setattr(stapo, "build_policy", build)
    with pytest.raises(Built) as seen:
        stapo.train(stapo.get_args(args_for(tiny[0], tmp_path, *flags)))
    assert seen.value.args == want


class HostReads(TorchDispatchMode):
    """The aten calls that make a GPU wait for the host, while `on`: a read of a tensor (.item(), float(),
    bool(): _local_scalar_dense, is_nonzero) and the calls whose output size is data (nonzero, masked_select,
    an index or index_put by a boolean mask)."""
    READS = {"_local_scalar_dense", "is_nonzero", "nonzero", "masked_select", "_unique2", "unique_consecutive"}

    def __init__(self):
        super().__init__()
        self.seen, self.on = [], True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        masks = name in ("index", "index_put", "index_put_") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in args[1])
        if self.on and (name in self.READS or masks):
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


def test_the_micro_batch_loops_never_wait_on_the_device(tiny, tmp_path, monkeypatch):
    """Inside the micro-batch loops of token_stats and update (the decoder, the head, the loss, the backward),
    no aten call needs a value on the host, so on a GPU the host queues the next micro-batch while the device
    runs this one. Only what runs once per mini-batch may read: the micro-batch count's all-reduce, and after
    the loop the statistics, the norms and the step. Breaks with the boolean-mask gathers of the former
    Policy.forward, its masked_scatter, or the head's backward indexing rows by a mask."""
    args, policy, opt, device, data, prompts, ids = one_step_on_four_prompts(tiny, tmp_path, "--micro-tokens", "80")
    rows = [(p, ids(f"\\boxed{{{a}}}" + " 1" * j)) for _, p, a in prompts for j in range(2)]
    idx = sorted(range(len(rows)), key=lambda i: len(rows[i][0]) + len(rows[i][1]))
    lengths = torch.tensor([len(r) for _, r in rows])
    valid = torch.arange(int(lengths.max())) < lengths[:, None]
    reads = HostReads()
    for module in (stapo, policies):
        monkeypatch.setattr(module, "micro_batches", reads.off_during(policies.micro_batches))
    tally = metrics.StepMetrics(0, "stapo")
    tally.loss_stats = reads.off_after(tally.loss_stats)  # after the loop: the statistics, norms, step
    assert len([m for m in policies.micro_batches(rows, idx, 80) if not m.idle]) >= 3  # several micro-batches
    keep = valid[idx].float()
    num_tokens = float(keep.sum())  # stapo.py's: a number all-reduced before the loop
    with reads:
        old = stapo.token_stats(policy, rows, idx, valid, args.micro_tokens, args.temperature)
        mb = stapo.MiniBatch(idx, old.logp, torch.linspace(-1, 1, len(idx)), keep, num_tokens)
        norm, _ = stapo.update(policy, opt, rows, valid, mb, args, tally)
    assert reads.seen == [] and norm > 0


def test_degenerate_batches_give_finite_steps(tiny, tmp_path):
    tok = tiny[1]
    args, policy, opt, device, data, prompts, ids = one_step_on_four_prompts(tiny, tmp_path, "--method", "stapo")
    right, wrong = ids(f"\\boxed{{{data[0][1]}}}"), ids("\\boxed{99}")
    groups = [[Sample(right, "stop")] * 4,                                   # all correct: zero advantage
              [Sample(ids("\\boxed{98}"), "stop")] * 4,                      # all wrong: zero advantage
              [Sample([], "stop")] * 2 + [Sample(ids(f"\\boxed{{{data[2][1]}}}"), "stop")] * 2,  # empty
              [Sample(wrong[:3], "length")] * 3 + [Sample(ids(f"\\boxed{{{data[3][1]}}}"), "stop")]]  # truncated
    engine = FixedEngine(groups, args.model, tok)
    before = {k: v.full_tensor().clone() for k, v in policy.state_dict().items()}
    for method in ("stapo", "justrl", "grpo", "entropy20"):
        args.method = method
        metrics, _ = stapo.train_step(0, policy, opt, engine, tok, prompts, args, device, PROBE)
        assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), metrics
        assert metrics["zero_variance_groups"] == 0.5 and metrics["truncated"] == 3 / 16
        assert metrics["response_len_mean"] == sum(len(s.tokens) for g in groups for s in g) / 16
    assert engine.synced == len(list(policy.parameters())) * 4
    after = policy.state_dict()
    assert all(torch.isfinite(v.full_tensor()).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k].full_tensor()) for k in before)

    # all groups degenerate: zero advantages everywhere, a zero loss, and a step that does not crash
    engine.groups = [[Sample(right, "stop")] * 4] * 4
    metrics, _ = stapo.train_step(1, policy, opt, engine, tok, prompts, args, device, PROBE)
    assert metrics["zero_variance_groups"] == 1.0 and metrics["grad_norm"] == 0.0


def test_a_non_finite_gradient_skips_the_update(tiny, tmp_path, monkeypatch, capsys):
    """A batch whose loss is NaN (every gradient NaN, so the global norm is too): the optimizer does not step,
    every weight stays finite and equal to what it was, Adam's state stays empty, and the row says each update
    was skipped, with one line on stderr. The next step, its loss finite, trains. Breaks with opt.step() on a
    NaN norm (the clip multiplies every gradient by NaN; AdamW writes it into the weights)."""
    tok = tiny[1]
    args, policy, opt, device, data, prompts, ids = one_step_on_four_prompts(tiny, tmp_path, "--minibatches", "2")
    groups = [[Sample(ids(f"\\boxed{{{a}}}"), "stop")] * 2 + [Sample(ids("\\boxed{99}"), "stop")] * 2
              for _, _, a in prompts]  # half right in every group: every update has a signal
    engine = FixedEngine(groups, args.model, tok)
    real_loss = stapo.stapo_loss
    def nan_loss(*a, **k):
        loss, st = real_loss(*a, **k)
        return loss * math.nan, st
    monkeypatch.setattr(stapo, "stapo_loss", nan_loss)
    before = {k: v.full_tensor().clone() for k, v in policy.state_dict().items()}
    metrics, _ = stapo.train_step(0, policy, opt, engine, tok, prompts, args, device, PROBE)
    after = {k: v.full_tensor() for k, v in policy.state_dict().items()}
    assert all(torch.equal(before[k], after[k]) for k in before) and not opt.state
    assert metrics["skipped_updates"] == 2 and math.isnan(metrics["grad_norm"])
    assert capsys.readouterr().err.count("the gradient norm is nan; this update is skipped") == 2
    assert all(p.grad is None for p in policy.parameters())  # zeroed: nothing carries into the next update
    monkeypatch.setattr(stapo, "stapo_loss", real_loss)
    metrics, _ = stapo.train_step(1, policy, opt, engine, tok, prompts, args, device, PROBE)
    assert metrics["skipped_updates"] == 0 and metrics["grad_norm"] > 0
    after = {k: v.full_tensor() for k, v in policy.state_dict().items()}
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)


NAN_LOSS = """
import math, sys
sys.path.insert(0, sys.argv[1])
import parallel, stapo
real = stapo.stapo_loss
stapo.stapo_loss = lambda *a, **k: (lambda loss, st: (loss * math.nan, st))(*real(*a, **k))
parallel.run_program(lambda: stapo.train(stapo.get_args(sys.argv[2:])))
"""


@pytest.mark.slow
def test_a_skipped_update_is_counted_once_on_two_ranks(tiny, tmp_path):
    """Two ranks, every loss NaN: each of the step's 2 updates is skipped on both ranks (the norm is global),
    and skipped_updates counts 2, not 4, with one line for each on stderr (rank 0's). Breaks with the count
    summed over ranks, as it was (one skipped update logged as 8 on 8 GPUs)."""
    d, _ = tiny
    (tmp_path / "nan.py").write_text(NAN_LOSS)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(tmp_path / "nan.py"), ROOT, *args_for(d, tmp_path / "out", "--steps", "1")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = metrics_of(tmp_path / "out")
    assert row["skipped_updates"] == 2 and math.isnan(row["grad_norm"])
    assert r.stderr.count("the gradient norm is nan; this update is skipped") == 2


def test_method_objectives_on_a_fixed_batch(tiny):
    parallel.init_distributed()
    args = stapo.get_args(["--tau-p", "0.5", "--q", "0.5"])
    logp = torch.tensor([[0.1, 0.6, 0.3, 0.9], [0.2, 0.2, 0.2, 0.2], [0.1, 0.45, 0.9, 0.9]]).log()
    ent = torch.tensor([[0.5, 0.1, 2.0, 0.3], [0.4, 0.4, 0.4, 0.4], [1.0, 0.2, 3.0, 0.7]])
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 0.5])
    s2t = stapo.spurious_tokens(logp, ent, adv, valid, args.tau_p, args.q)
    # justrl: every valid token, one global count
    scale, num_tokens = stapo.token_scales("justrl", ent, valid, s2t)
    assert torch.equal(scale, valid) and num_tokens == 9
    # stapo: candidates (A > 0, p < 0.5, valid) are (0,0) H .5, (0,2) H 2, (2,0) H 1, (2,1) H .2;
    # median of [.2 .5 1 2] = .75, silenced: H < .75 -> (0,0), (2,1)
    scale, num_tokens = stapo.token_scales("stapo", ent, valid, s2t)
    silenced = torch.zeros_like(valid)
    silenced[0, 0] = silenced[2, 1] = True
    assert torch.equal(s2t.silenced, silenced) and torch.equal(scale, valid & ~silenced) and num_tokens == 7
    assert s2t.n_candidates == 4 and s2t.tau_h == pytest.approx(0.75)
    assert torch.equal(s2t.candidates.nonzero(), torch.tensor([[0, 0], [0, 2], [2, 0], [2, 1]]))
    # grpo: 1/|o_i| per token, the mean over sequences
    scale, num_tokens = stapo.token_scales("grpo", ent, valid, s2t)
    assert torch.allclose(scale, valid / torch.tensor([[3.0], [2.0], [4.0]])) and num_tokens == 3
    # entropy20: the top 20% entropy among the 9 valid tokens: 0.8-quantile of
    # the valid H = .5 .1 2 | .4 .4 | 1 .2 3 .7, sorted [.1 .2 .4 .4 .5 .7 1 2 3]: position 6.4 -> 1.4
    scale, num_tokens = stapo.token_scales("entropy20", ent, valid, s2t)
    expect = valid & (ent >= 1.4)
    assert torch.equal(scale, expect) and num_tokens == 2  # H = 2 and H = 3


# ---- data -------------------------------------------------------------------------------------------------

def test_local_jsonl_bad_rows_name_file_line_and_field(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"problem": "1+1", "answer": "2"}\n\n{"problem": "2+2"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: missing field 'answer'"):
        problems.load_problems(str(p))
    p.write_text('{"problem": "1+1", "answer": "2"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        problems.load_problems(str(p))
    with pytest.raises(ValueError, match=r"x\.jsonl:1: missing field 'answer'"):
        (tmp_path / "x.jsonl").write_text('{"problem": "1"}\n')
        problems.read_jsonl(str(tmp_path / "x.jsonl"), ["problem", "answer"])


def test_parquet_and_dedup(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"problem": ["a", "b", "a"], "answer": ["1", "2", "1"]}), tmp_path / "d.parquet")
    assert problems.load_problems(str(tmp_path / "d.parquet")) == [("a", "1"), ("b", "2")]


def test_dapo_nested_schema_unwrapped_and_deduplicated(tmp_path):
    path, full = (os.path.join(SHARED, "train", f"dapo_math_17k{s}.jsonl") for s in ("_sample", ""))
    for f in (path, full):
        if not os.path.exists(f):
            pytest.skip(f"../shared/data/train/{os.path.basename(f)} is absent")
    rows = open(path).read().splitlines()
    (tmp_path / "dapo.jsonl").write_text("\n".join(rows + rows) + "\n")  # the Hub repeats every prompt
    got = problems.load_problems(str(tmp_path / "dapo.jsonl"))
    assert [a for _, a in got] == ["34", "113", "-3"]
    assert not any("Answer:" in p for p, _ in got)
    flat = [json.loads(x) for x in open(full).read().splitlines()[:3]]
    assert [p for p, _ in got] == [r["problem"] for r in flat]  # exactly the problem, whitespace kept


def test_prompt_suffix_and_chat_template(tiny):
    _, tok = tiny
    ids = problems.encode_prompt(tok, "What is 1 + 2?")
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>user\nWhat is 1 + 2?" + problems.SUFFIX) and text.endswith("assistant\n")
    raw = tok.decode(problems.encode_prompt(tok, "What is 1 + 2?", chat_template=False))
    assert raw == "What is 1 + 2?" + problems.SUFFIX


def test_bad_split_is_an_error(tiny, tmp_path):
    d, _ = tiny
    with pytest.raises(ValueError, match="--prompts-per-step 4 must split evenly into --minibatches 3"):
        stapo.train(stapo.get_args(args_for(d, tmp_path, "--minibatches", "3")))


def test_micro_batches_are_cut_where_the_fewest_tokens_are_computed():
    """policy.cut_by_length against every way to cut short sorted lists into micro-batches, each within the
    budget (or one sample alone), in order: the tokens computed (each padded to its longest) plus a cost per
    micro-batch are the least there is, at the trainer's cost and at others; at a cost that outweighs any
    padding, that is the fewest micro-batches that fit. A micro-batch padded to its shortest, a cut one sample
    late or early, or the greedy cut (the fewest, each as long as fits) in its place fails it."""
    import itertools
    import random
    rng = random.Random(0)
    for _ in range(400):
        n = sorted(rng.choice([rng.randint(1, 40), rng.randint(1, 8)]) for _ in range(rng.randint(1, 9)))
        budget, cost = rng.randint(8, 80), rng.choice([policies.MICRO_BATCH_COST, 0.0, 0.5, 1e6])
        scored = []
        for cuts in itertools.product((0, 1), repeat=len(n) - 1):
            bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [len(n)]
            parts = list(zip(bounds, bounds[1:]))
            if all(e - s == 1 or (e - s) * n[e - 1] <= budget for s, e in parts):
                scored.append((len(parts), sum((e - s) * n[e - 1] for s, e in parts) + cost * budget * len(parts)))
        got = policies.cut_by_length(n, budget, cost)
        assert [i for part in got for i in range(len(n))[part]] == list(range(len(n))), (n, got)
        assert all(p.stop - p.start == 1 or (p.stop - p.start) * n[p.stop - 1] <= budget for p in got), (n, got)
        total = sum(len(n[p]) * n[p.stop - 1] + cost * budget for p in got)
        assert math.isclose(total, min(x[1] for x in scored)), (n, budget, cost, got)
        if cost == 1e6:
            assert len(got) == min(x[0] for x in scored), (n, budget, got)
    assert policies.cut_by_length([], 10) == []
    assert policies.cut_by_length([50, 60], 10) == [slice(0, 1), slice(1, 2)]


def test_a_rank_with_fewer_micro_batches_runs_idle_ones(monkeypatch):
    """Every rank runs as many micro-batches as the rank with the most (FSDP's collectives meet in each): the
    others come idle, the mini-batch's first sample at weight 0. Breaks if the count is this rank's own, or
    an idle micro-batch is not marked so (its sample would be trained on twice)."""
    monkeypatch.setattr(policies, "all_reduce_numbers", lambda n, op: [5.0])  # another rank cuts 5
    rows = [([1] * 4, [2] * k) for k in (2, 3, 3, 9)]
    got = policies.micro_batches(rows, [0, 1, 2, 3], 24)
    assert got[:2] == [(slice(0, 3), False), (slice(3, 4), False)]  # 3 samples padded to 7, then 13 alone
    assert got[2:] == [(slice(0, 1), True)] * 3


def test_step_prompts_split_by_minibatch_and_cover_each_epoch_once():
    data = [(f"p{i}", str(i)) for i in range(10)]
    one = [problems.step_prompts(data, s, 4, 2, 3, 0, 1) for s in range(5)]  # 4 prompts, 2 mini-batches, seed 3
    for s in range(5):  # two ranks hold, mini-batch by mini-batch, what one process holds
        r0, r1 = (problems.step_prompts(data, s, 4, 2, 3, r, 2) for r in (0, 1))
        assert one[s] == [r0[0], r1[0], r0[1], r1[1]]
    flat = [x for step in one for x in step]
    assert [g for g, _, _ in flat] == list(range(20))
    for epoch in (0, 1):  # steps 2 spans the epoch boundary; each epoch is a permutation of the data
        assert sorted(p for g, p, _ in flat if g // 10 == epoch) == sorted(p for p, _ in data)
    assert [p for g, p, _ in flat[:10]] != [p for g, p, _ in flat[10:]]  # reshuffled each epoch


def test_a_model_whose_logits_policy_would_get_wrong_is_refused(tmp_path):
    """Gemma-2 soft-caps its logits: Policy's hidden @ lm_head.weight would silently give wrong log-probs."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16)
    Gemma2ForCausalLM(cfg).save_pretrained(tmp_path / "gemma2")
    _, _, device, mesh = parallel.init_distributed()
    with pytest.raises(ValueError, match=r"gemma2: its logits are not hidden @ lm_head.weight "
                                         r"\(final_logit_softcapping=30.0\)"):
        stapo.build_policy(str(tmp_path / "gemma2"), mesh, device)


def test_the_hf_export_keeps_the_checkpoint_dtype(tiny, tmp_path):
    """Trained in fp32, exported in the dtype the starting checkpoint declares (Qwen3 ships bf16)."""
    from transformers import AutoModelForCausalLM
    d, _ = tiny
    AutoModelForCausalLM.from_pretrained(d / "model", dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / "bf16" / f).write_bytes((d / "model" / f).read_bytes())
    stapo.train(stapo.get_args(args_for(d, tmp_path / "run", "--model", str(tmp_path / "bf16"), "--steps", "1")))
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")
    assert json.load(open(tmp_path / "run" / "model" / "config.json"))["dtype"] == "bfloat16"
    assert out.lm_head.weight.dtype == torch.bfloat16


TWO_RANK_WEIGHTS = """
import json, os, sys, torch
sys.path.insert(0, sys.argv[1])
import parallel, stapo
rank, world, _, _ = parallel.init_distributed()
g = torch.Generator().manual_seed(0)
logp, ent = -torch.rand(8, 5, generator=g) * 4, torch.rand(8, 5, generator=g) * 3
adv, valid = torch.randn(8, generator=g), torch.rand(8, 5, generator=g) < 0.8
args = stapo.get_args(["--tau-p", "0.5", "--q", "0.6"])
rows = slice(0, 8) if world == 1 else [slice(0, 2), slice(2, 8)][rank]  # unequal shares
out = {}
s2t = stapo.spurious_tokens(logp[rows], ent[rows], adv[rows], valid[rows], args.tau_p, args.q)
for method in ("stapo", "entropy20", "justrl", "grpo"):
    scale, num_tokens = stapo.token_scales(method, ent[rows], valid[rows], s2t)
    out[method] = {"scale": parallel.gather(scale.float().tolist()), "num_tokens": num_tokens,
                   "tau_h": s2t.tau_h, "candidates": s2t.n_candidates}
if rank == 0:
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
torch.distributed.barrier()  # every rank's work is done
os._exit(0)  # no teardown, as tests/contract_ddp.py ends (a rank once aborted at this script's end in CI)
"""


@pytest.mark.slow
def test_token_scales_on_two_ranks_equal_one_process(tmp_path):
    """Each rank holds a different, unequal share of a mini-batch: the keep mask, the denominator, tau_h
    and the candidate count must be those of one process holding all of it (a per-rank quantile fails)."""
    (tmp_path / "w.py").write_text(TWO_RANK_WEIGHTS)
    run_py = [sys.executable, str(tmp_path / "w.py"), ROOT]
    subprocess.run(run_py + [str(tmp_path / "one.json")], check=True, timeout=300)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    *run_py[1:], str(tmp_path / "two.json")], check=True, timeout=300)
    one, two = (json.load(open(tmp_path / f)) for f in ("one.json", "two.json"))
    for method in one:
        assert sum(two[method]["scale"], []) == one[method]["scale"][0], method
        assert two[method]["num_tokens"] == one[method]["num_tokens"], method
    assert two["stapo"]["tau_h"] == pytest.approx(one["stapo"]["tau_h"]) and one["stapo"]["candidates"] >= 4
    assert 0 < sum(map(sum, one["stapo"]["scale"][0])) < sum(map(sum, one["justrl"]["scale"][0]))  # some silenced


def test_an_unchanged_policy_has_a_ratio_of_exactly_one_in_every_mini_batch(tiny, tmp_path, monkeypatch, one_thread):
    """At lr 0 the policy never moves, so every mini-batch's ratio must be exactly 1 in fp32: the old log-probs
    are computed in the micro-batches the update runs (the same padded shapes). Old log-probs of mini-batches
    1.. computed together, in other groupings, move the ratio by float noise (in bf16 by up to 0.05 nats)."""
    d, _ = tiny
    seen, passes = [], []
    real_loss, real_pass = stapo.stapo_loss, stapo.token_stats

    def recording(logp, old_logp, adv, keep, *a, **k):
        seen.append((logp.detach() - old_logp)[keep > 0])
        return real_loss(logp, old_logp, adv, keep, *a, **k)

    def token_stats(policy, rows, idx, *a, **k):
        passes.append(sorted(idx))
        return real_pass(policy, rows, idx, *a, **k)
    monkeypatch.setattr(stapo, "stapo_loss", recording)
    monkeypatch.setattr(stapo, "token_stats", token_stats)
    for micro in ("40", "4096"):  # several unequal micro-batches per mini-batch; one
        seen.clear()
        passes.clear()
        stapo.train(stapo.get_args(args_for(d, tmp_path / micro, "--steps", "1", "--lr", "0", "--minibatches", "4",
                                            "--prompts-per-step", "8", "--micro-tokens", micro)))
        assert len(seen) >= 4 and sum(x.numel() for x in seen) > 50
        assert all(torch.equal(x, torch.zeros_like(x)) for x in seen), [x.abs().max() for x in seen]
        blocks = [list(range(b * 8, b * 8 + 8)) for b in range(4)]  # 4 mini-batches of 2 prompts x 4 samples
        assert passes[:4] == blocks  # the old pass: mini-batch by mini-batch, each then micro-batched alone
        assert passes[4:] == blocks[1:]  # then the current policy's, after each update (none before the first)



@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_trainer_with_compiled_layers_trains_as_with_eager_ones(tiny, tmp_path, monkeypatch, one_thread, dtype):
    """stapo.train with its decoder layers compiled by inductor (what a GPU runs, lowered to C++ here), against
    eager layers. At lr 0 every mini-batch's ratio is exactly 1 in every micro-batch, in fp32 and bf16: the old
    pass's no-grad graphs and the update's training graphs compute the same log p (so here; docs/training.md:
    compiled layers). Trained a step of 4 updates at lr 1e-3, the model and every metric match eager layers':
    fp32, within assert_same_params' 2e-5 and 1e-4 of each metric (reordered sums); bf16, the same samples, the
    gradient norm within 5% and the model within 1e-2. No layer call runs eager.
    Breaks if compiled layers compute something else, if the old pass and the update disagree (a ratio off 1
    clips, and the loss is not the paper's), or if the layers fall back to eager."""
    d, _ = tiny
    seen, real_loss = [], stapo.stapo_loss

    def recording(logp, old_logp, adv, keep, *a, **k):
        seen.append((logp.detach().float() - old_logp.float())[keep > 0])
        return real_loss(logp, old_logp, adv, keep, *a, **k)
    monkeypatch.setattr(stapo, "stapo_loss", recording)
    common = ("--minibatches", "4", "--prompts-per-step", "8", "--micro-tokens", "40", "--dtype", dtype)
    torch._dynamo.reset()
    try:
        stapo.train(stapo.get_args(args_for(d, tmp_path / "lr0", "--steps", "1", "--lr", "0", "--compile-layers",
                                            "on", *common)))
        assert len(seen) >= 8 and all(torch.equal(x, torch.zeros_like(x)) for x in seen), [x.abs().max() for x in seen]
        m = metrics_of(tmp_path / "lr0")[0]
        print(f"compiled {dtype}: ratio 1 in {len(seen)} micro-batches; sync probe gap {m['sync_probe_gap_mean']:.2e} "
              f"mean, {m['sync_probe_gap']:.2e} max")
        trained = ("--steps", "1", "--lr", "1e-3", "--warmup-steps", "0", *common)
        stapo.train(stapo.get_args(args_for(d, tmp_path / "compiled", "--compile-layers", "on", *trained)))
    finally:
        torch._dynamo.reset()
    stapo.train(stapo.get_args(args_for(d, tmp_path / "eager", *trained)))
    compiled, eager = metrics_of(tmp_path / "compiled"), metrics_of(tmp_path / "eager")
    assert all(x["eager_layer_calls"] == 0 for x in compiled + [m])
    for x in compiled + eager:  # the sync's probe gap is the trainer's against the engine's eager layers
        x.pop("eager_layer_calls", None), x.pop("sync_probe_gap"), x.pop("sync_probe_gap_mean")
    a, b = load_params(tmp_path / "compiled" / "model"), load_params(tmp_path / "eager" / "model")
    if dtype == "fp32":
        assert_same_params(a, b)
        assert_same_metrics(compiled, eager)
    else:
        assert compiled[0]["reward_mean"] == eager[0]["reward_mean"]  # the same samples in step 1
        assert compiled[0]["grad_norm"] == pytest.approx(eager[0]["grad_norm"], rel=0.05)
        assert_same_params(a, b, atol=1e-2)


def test_the_eight_groups_and_the_gradient_shares_by_hand(tiny):
    """Two rows of three tokens, A = +1 and -1, tau_p 0.5; S2T's candidates (0,0) H .2 and (0,2) H .9 give
    tau_h = .725, which splits H: each token lands in its group, (0,0) alone in the spurious group, the set
    S2T silences. Ratios of 1.5 at (0,1) (A > 0: clip-higher) and 0.5 at (1,0) (A < 0: the lower clip) zero
    those tokens' applied gradient; the silenced token's is zero too, and its share if kept is logged beside.
    Breaks with the median H as the entropy cut ((1,0), H .5, would be high-H), the unclipped weight in the
    shares, or the plain-gradient entropy change."""
    parallel.init_distributed()
    args = stapo.get_args(["--tau-p", "0.5"])
    p = torch.tensor([[0.1, 0.9, 0.2], [0.8, 0.3, 0.6]])
    ent = torch.tensor([[0.2, 0.1, 0.9], [0.5, 0.3, 0.4]])
    collision = torch.tensor([[0.8, 0.82, 0.3], [0.66, 0.4, 0.45]])  # each >= p^2
    ratio = torch.tensor([[1.0, 1.5, 1.0], [0.5, 1.0, 1.0]])
    adv, valid = torch.tensor([1.0, -1.0]), torch.ones(2, 3, dtype=torch.bool)
    old = p.log() - ratio.log()
    s2t = stapo.spurious_tokens(p.log(), ent, adv, valid, args.tau_p, args.q)
    assert s2t.silenced.nonzero().tolist() == [[0, 0]] and s2t.tau_h == pytest.approx(0.725)
    keep, ones = (valid & ~s2t.silenced).float(), valid.float()  # no --rollout-is: its weights are 1
    m = analysis.TokenAnalysis("stapo", stapo.clip_settings(args), args.tau_p, args.temperature)
    now, sums = policies.TokenStats(p.log(), ent, collision), dict.fromkeys(analysis.KEYS, 0.0)
    metrics.accumulate(sums, m.sums(now, old, adv, valid, keep, 5.0, s2t, ones))
    w = ratio * adv[:, None]  # the policy-gradient term's weight, ratio * A
    norm = w.abs() * (1 - 2 * p + collision).sqrt()  # T = 1
    change = -w * p * (p.log() + ent)
    groups = {"posA_lowP_lowH": [(0, 0)], "posA_highP_lowH": [(0, 1)], "posA_lowP_highH": [(0, 2)],
              "negA_highP_lowH": [(1, 0), (1, 2)], "negA_lowP_lowH": [(1, 1)]}
    for g in analysis.GROUPS:
        cells = groups.get(g, [])
        assert sums[f"{g}/n"] == len(cells), g
        assert sums[f"{g}/norm"] == pytest.approx(sum(norm[c].item() for c in cells)), g
        assert sums[f"{g}/dH"] == pytest.approx(sum(change[c].item() for c in cells)), g
    applied = (1 - 2 * p + collision).sqrt() / 5  # |A| r keep / n, where the term is live
    assert sums["g2/silenced"] == 0 and sums["g2/silenced_if_kept"] == pytest.approx(applied[0, 0].item() ** 2)
    assert sums["g2/candidates_kept"] == pytest.approx(applied[0, 2].item() ** 2)
    assert sums["g2/rest"] == pytest.approx(applied[1, 1].item() ** 2 + applied[1, 2].item() ** 2)
    row = analysis.shares_row(sums)
    assert row["grad_share/silenced"] == 0 and row["grad_share/rest"] + row["grad_share/candidates_kept"] == 1
    if_kept = sums["g2/silenced_if_kept"] / (sums["g2/silenced_if_kept"] + sums["g2/candidates_kept"] + sums["g2/rest"])
    assert row["grad_share/silenced_if_kept"] == pytest.approx(if_kept)
    assert sums["split"] == sums["nonzero"] == 6
    none = stapo.spurious_tokens(p.log(), ent, -adv.abs(), valid, args.tau_p, args.q)  # A < 0: no candidate, no tau_h
    metrics.accumulate(sums, m.sums(now, old, -adv.abs(), valid, valid.float(), 6.0, none, ones))
    assert none.tau_h is None and sums["split"] == 6 and sums["nonzero"] == 12
    assert sum(sums[f"{g}/n"] for g in analysis.GROUPS) == 6  # the mini-batch with no tau_h is in no group
    assert analysis.taxonomy_row(sums)["taxonomy/split"] == 0.5


def test_rollout_is_weights_the_loss_and_is_exact_when_the_sampler_agrees(tiny, tmp_path):
    """A sampler whose log-probs equal the trainer's (rho = 1): --rollout-is token leaves the update bit for bit
    what --rollout-is none gives. A sampler that reports log p = 0 (p = 1): rho = the trainer's p, logged
    as the ratio's min, mean and max, and the update moves differently."""
    d, tok = tiny
    rank, world, device, mesh = parallel.init_distributed()
    data = problems.load_problems(str(d / "train.jsonl"))[:4]
    prompts = [(i, problems.encode_prompt(tok, p), a) for i, (p, a) in enumerate(data)]
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # noqa: E731
    rows = [(p, ids(f"\\boxed{{{a}}}" if j < 2 else "\\boxed{99}")) for i, p, a in prompts for j in range(4)]
    valid = torch.ones(16, max(len(r) for _, r in rows), dtype=torch.bool)
    valid &= torch.arange(valid.shape[1]) < torch.tensor([len(r) for _, r in rows])[:, None]
    args = stapo.get_args(args_for(d, tmp_path, "--minibatches", "1", "--micro-tokens", "4096", "--warmup-steps", "0"))
    results = {}
    for mode, sampler in [("none", "trainer"), ("token", "trainer"), ("token", "zero")]:
        policy = stapo.build_policy(args.model, mesh, device)
        order = sorted(range(16), key=lambda i: len(rows[i][0]) + len(rows[i][1]))  # as split_minibatches
        trainer_logp = stapo.token_stats(policy, rows, order, valid, args.micro_tokens, args.temperature)
        logp = torch.zeros(valid.shape)
        logp[order] = trainer_logp.logp
        groups = [[Sample(rows[i * 4 + j][1], "stop", logp[i * 4 + j][valid[i * 4 + j]].tolist()
                          if sampler == "trainer" else [0.0] * len(rows[i * 4 + j][1])) for j in range(4)]
                  for i in range(4)]
        args.rollout_is = mode
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        metrics, _ = stapo.train_step(0, policy, opt, FixedEngine(groups, args.model, tok), tok, prompts, args,
                                      device, PROBE)
        results[(mode, sampler)] = metrics, {k: v.full_tensor().clone() for k, v in policy.state_dict().items()}
    none, same, zero = results[("none", "trainer")], results[("token", "trainer")], results[("token", "zero")]
    assert none[0]["reward_mean"] == 0.0 and none[0]["grad_norm"] > 0  # half right: the update is not empty
    assert all(torch.equal(none[1][k], same[1][k]) for k in none[1])
    assert same[0]["rollout_is_min"] == same[0]["rollout_is_max"] == 1.0
    p = logp[valid].exp()
    assert zero[0]["rollout_is_min"] == pytest.approx(p.min().item(), rel=1e-5)
    assert zero[0]["rollout_is_mean"] == pytest.approx(p.mean().item(), rel=1e-5)
    assert zero[0]["rollout_is_max"] == pytest.approx(p.max().item(), rel=1e-5)
    assert any(not torch.equal(none[1][k], zero[1][k]) for k in none[1])


@pytest.mark.slow
def test_a_tied_model_trains_on_one_and_two_ranks_resumes_and_exports_tied(tiny, tmp_path):
    """Qwen3-0.6B, 1.7B and 4B tie their embedding and LM head. Through the HF engine: 1 rank for 2 steps, then
    2 ranks resuming for a third; the export loads in transformers, still tied, and the shared matrix trained."""
    from reference import toy_model
    from transformers import AutoModelForCausalLM
    d, _ = tiny
    toy_model(tmp_path / "tied", tied=True)
    argv = args_for(d, tmp_path / "run", "--model", str(tmp_path / "tied" / "model"), "--save-every", "2",
                    "--tau-p", "0.9", "--weight-decay", "0")  # what moves the weights is the gradient
    stapo.train(stapo.get_args(argv + ["--steps", "2"]))
    run(argv + ["--steps", "3", "--resume"], nproc=2)
    m = metrics_of(tmp_path / "run")
    assert [x["step"] for x in m] == [1, 2, 3] and all(x["grad_norm"] > 0 for x in m)
    before = AutoModelForCausalLM.from_pretrained(tmp_path / "tied" / "model")
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")
    assert after.lm_head.weight is after.model.embed_tokens.weight
    assert not torch.allclose(after.lm_head.weight, before.lm_head.weight)


def test_memory_peak_on_cuda_leaves_out_what_torch_allocated_in_vllms_pool(monkeypatch):
    """On a GPU, vLLM's sleep mode allocates through torch's allocator in a pool of its own (CuMemAllocator,
    whose pointer_to_data is keyed by each segment's address), so torch's peak counts vLLM's weights and KV
    cache in every phase; peak_gb/* is the trainer's own. The segments outside that pool still count."""
    import types
    import metrics
    gib = 2**30
    segments = [{"address": 1000, "allocated_size": 40 * gib},  # vLLM's weights and KV cache, asleep or not
                {"address": 2000, "allocated_size": 3 * gib},   # the trainer's
                {"address": 3000, "allocated_size": 2 * gib}]   # vLLM's too
    allocator = types.SimpleNamespace(pointer_to_data={1000: object(), 3000: object()})
    cumem = types.SimpleNamespace(CuMemAllocator=types.SimpleNamespace(instance=allocator))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 50 * gib)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", cumem)
    assert metrics.memory_peak() == 8.0
    monkeypatch.delitem(sys.modules, "vllm.device_allocator.cumem")  # no engine with sleep mode: all counts
    assert metrics.memory_peak() == 50.0


def test_reward_dapo_trains_on_the_papers_reward(tiny, tmp_path):
    """--reward dapo scores the step's samples with DAPO's strict box (reward.dapo_score): a zero-padded
    `\\boxed{017}` for the gold 17 is right under the default equivalence checker and wrong under DAPO's string
    match. Per prompt: the exact box, the padded box, two wrong ones; accuracy 1/2 (equiv) against 1/4 (dapo).
    Breaks if the flag does not reach score_all (both give 1/2)."""
    d, tok = tiny
    rank, world, device, mesh = parallel.init_distributed()
    data = problems.load_problems(str(d / "train.jsonl"))[:4]
    prompts = [(i, problems.encode_prompt(tok, p), a) for i, (p, a) in enumerate(data)]
    assert all(a.isdigit() and a != "99" for _, _, a in prompts)
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # noqa: E731
    texts = ["\\boxed{%s}", "\\boxed{0%s}", "\\boxed{99}", "\\boxed{99}"]
    groups = [[Sample(ids(t % a if "%" in t else t), "stop") for t in texts] for _, _, a in prompts]
    accuracy = {}
    for reward in ("equiv", "dapo"):
        args = stapo.get_args(args_for(d, tmp_path, "--lr", "0", "--reward", reward))
        policy = stapo.build_policy(args.model, mesh, device)
        opt = torch.optim.AdamW(policy.parameters(), lr=0.0)
        row, _ = stapo.train_step(0, policy, opt, FixedEngine(groups, args.model, tok), tok, prompts, args,
                                  device, PROBE)
        accuracy[reward] = row["accuracy"]
    assert accuracy == {"equiv": 0.5, "dapo": 0.25}


def test_the_warm_up_is_verls_as_justrl_runs_it():
    """lr * t / W at RL step t < W, then lr (verl 0.4.0's get_constant_schedule_with_warmup, stepped once per RL
    step): 0 at step 0, 0.1 lr at step 1, 0.9 lr at step 9, lr from step 10; W = 0 is lr from the start. Breaks
    with a schedule one step ahead, (t + 1) / W."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    args = stapo.get_args(["--lr", "1e-6", "--warmup-steps", "10"])
    lrs = [stapo.set_lr(opt, args, t) for t in (0, 1, 9, 10, 500)]
    assert lrs == pytest.approx([0.0, 1e-7, 9e-7, 1e-6, 1e-6], abs=1e-15) and opt.param_groups[0]["lr"] == 1e-6
    assert stapo.set_lr(opt, stapo.get_args(["--lr", "1e-3", "--warmup-steps", "0"]), 0) == 1e-3


def test_the_lm_heads_gradient_norm_is_logged_per_update(tiny, tmp_path, monkeypatch):
    """lm_head_grad_norm holds one number per update (--minibatches of them), each the norm of the LM head's
    gradient before the update's clip, at most the whole model's norm in that update (grad_norm is their mean
    over the step). Breaks with the whole model's norm, a norm after the clip (clipped here to 1e-6), or one
    number per step."""
    d, _ = tiny
    heads, wholes, real_clip = [], [], torch.nn.utils.clip_grad_norm_

    def clip(params, max_norm):  # the head's gradient as the clip finds it, then a clip to 1e-6
        heads.append(float(stapo_policy[0].lm.get_output_embeddings().weight.grad.full_tensor().norm()))
        wholes.append(real_clip(params, 1e-6))
        return wholes[-1]
    stapo_policy, real_build = [], stapo.build_policy
    monkeypatch.setattr(stapo, "build_policy", lambda *a: stapo_policy.append(real_build(*a)) or stapo_policy[0])
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    stapo.train(stapo.get_args(args_for(d, tmp_path, "--steps", "2", "--minibatches", "2", "--warmup-steps", "0")))
    m = metrics_of(tmp_path)
    assert [len(x["lm_head_grad_norm"]) for x in m] == [2, 2]
    assert [v for x in m for v in x["lm_head_grad_norm"]] == pytest.approx(heads, rel=1e-6)
    assert max(heads) > 1e-4  # above the clip: a norm read after it would be 1e-6 at most
    assert all(w >= h for w, h in zip(map(float, wholes), heads))  # the head is part of the whole model
    # per update, not per step: an update whose gradient is 0 pulls the step's mean below
    # another update's head norm (seen with ATEN_CPU_CAPABILITY=default)
    assert [x["grad_norm"] for x in m] == pytest.approx([float(sum(wholes[:2])) / 2, float(sum(wholes[2:])) / 2])


def test_a_signal_during_a_save_stops_at_that_steps_end(tiny, tmp_path, monkeypatch, capsys):
    """SIGTERM while step 2's --save-every checkpoint is written: the run stops after step 2, with that checkpoint,
    not after step 3 (a check made only before the save would see the signal a step late). The handler prints
    nothing: it only records. The engine is closed on this exit too (once: a vLLM engine left asleep at exit
    makes CuMem print CUDA errors)."""
    d, _ = tiny
    real_save, closed = checkpoint.save_checkpoint, []
    monkeypatch.setattr(rollout.HFEngine, "close", lambda self: closed.append(self))

    def save_and_get_signalled(*a, **k):
        real_save(*a, **k)
        os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(checkpoint, "save_checkpoint", save_and_get_signalled)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit, match="stopped by a signal after step 2, checkpointed in"):
        stapo.train(stapo.get_args(args_for(d, tmp_path, "--steps", "5", "--save-every", "2")))
    assert [x["step"] for x in metrics_of(tmp_path)] == [1, 2]
    assert checkpoint.checkpoints(str(tmp_path)) == [2]
    assert signal.getsignal(signal.SIGTERM) == before  # the trainer's handler is gone with the run
    assert "SIGTERM" not in capsys.readouterr().err
    assert len(closed) == 1


def test_the_engine_is_closed_when_its_first_sync_fails(tiny, tmp_path, monkeypatch):
    """The first weight sync, the likeliest first failure on a new GPU node, fails: the engine is closed (vLLM's
    shutdown runs before the process groups are gone), once, and the sync's error is the one raised. Breaks
    with the engine's close opened only after the first sync."""
    d, _ = tiny
    closed = []
    monkeypatch.setattr(rollout.HFEngine, "close", lambda self: closed.append(self))

    def broken_sync(*a):
        raise RuntimeError("engine weight sync: a mis-mapped sync")
    monkeypatch.setattr(stapo, "sync_engine", broken_sync)
    with pytest.raises(RuntimeError, match="a mis-mapped sync"):
        stapo.train(stapo.get_args(args_for(d, tmp_path, "--steps", "1")))
    assert len(closed) == 1


@pytest.mark.slow
def test_a_users_error_is_one_line_and_exit_code_2(tiny, tmp_path, capsys):
    """A wrong flag value, a missing model folder, a malformed dataset line and a used --out each end the run with
    one line naming the flag, file or line, exit code 2 and no traceback; under torchrun rank 0 alone prints it
    (torchrun's own report of the failed workers follows). The single-process cases run through stapo.py's own
    main (parallel.run_program over train) in this process; the torchrun case is real processes. Breaks with a
    traceback before the message (an exception left to Python), a message from every rank, or another exit
    code."""
    d, _ = tiny
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "What is 1 + 1?", "answer": "2"}\nnot json\n')
    used = tmp_path / "used"
    used.mkdir()
    (used / "metrics.jsonl").write_text('{"step": 3}\n')
    cases = {"--prompts-per-step 4 must split evenly into --minibatches 3": ["--minibatches", "3"],
             "--model /nonexistent/model: no such folder": ["--model", "/nonexistent/model"],
             f"{bad}:2: not valid JSON": ["--dataset", str(bad)],
             f"--out {used} already holds a run: metrics.jsonl logged to step 3": ["--out", str(used)],
             "argument --lr: invalid float value: 'fast'": ["--lr", "fast"]}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for message, flags in cases.items():
        argv = args_for(d, tmp_path / "out", *flags)
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            parallel.run_program(lambda: stapo.train(stapo.get_args(argv)))  # stapo.py's __main__
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert stop.value.code == 2 and len(lines) == 1 and message in lines[0], (message, stop.value.code, lines)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        os.path.join(ROOT, "stapo.py"), *args_for(d, tmp_path / "out2", "--dataset", str(bad))],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode != 0 and r.stderr.count(f"{bad}:2: not valid JSON") == 1, r.stderr[-3000:]
    assert "stapo.py\", line" not in r.stderr and "exitcode  : 2" in r.stderr  # no trace of ours; torchrun's report
