"""Stopping and resuming: SIGTERM and Ctrl-C checkpoint at a step's end, restarts under torchrun, a crash
mid-save, a used --out refused, the engine closed on every exit."""
import json
import os
import signal
import subprocess
import sys

import pytest

import checkpoint
import eval as ev
import parallel
import rollout
import stapo
from support import ROOT, args_for, load_params, assert_same_params, assert_same_metrics, metrics_of, torchrun, wait_for_steps, finish, tree_hashes


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
