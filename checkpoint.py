"""checkpoint.py: a run's checkpoints and its exported model. out/ckpt/step_N holds the sharded model and
optimizer (torch.distributed.checkpoint) and an HF copy; a checkpoint is renamed into place only when whole.
A used --out is resumed or refused, and SIGTERM or SIGINT checkpoints at the next step boundary.
"""
import json
import os
import shutil
import signal
import threading
import time

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict)

from parallel import all_reduce_numbers, gather, require_shared


def save_hf(policy, tok, path, rank):
    """An HF-format model (loadable by transformers and vLLM) in the dtype of the checkpoint it
    started from (Qwen3: bf16), and the tokenizer, written by rank 0."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(policy.lm, options=options)
    if rank == 0:
        exported = {k: v.to(policy.lm.export_dtype) for k, v in sd.items()}
        policy.lm.save_pretrained(path, state_dict=exported)
        policy.lm.config.dtype = policy.lm.export_dtype  # not the fp32 masters' dtype
        policy.lm.config.save_pretrained(path)
        tok.save_pretrained(path)


def save_checkpoint(out, step, policy, opt, tok, rank, keep=2, data_position=None):
    """out/ckpt/step_N: hf/ (the model), dcp/ (sharded model + optimizer), state.json. Written
    under a temporary name and renamed when complete, so a crash never leaves half a checkpoint;
    only the newest `keep` are kept (0: all). No RNG state: a sample's seed is (seed, step, prompt)."""
    final = os.path.join(out, "ckpt", f"step_{step}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(policy, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(tmp, "dcp"))
    save_hf(policy, tok, os.path.join(tmp, "hf"), rank)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(tmp, "state.json"), "w") as f:
            json.dump({"step": step, "data_position": data_position}, f)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        for old in checkpoints(out)[:-keep] if keep > 0 else []:
            shutil.rmtree(os.path.join(out, "ckpt", f"step_{old}"))
    dist.barrier()


def checkpoints(out):
    """The steps of the complete checkpoints under out/ckpt, oldest first."""
    root = os.path.join(out, "ckpt")
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(d[5:]) for d in names if d.startswith("step_") and d[5:].isdigit())


def load_checkpoint(policy, opt, out):
    """Restore the latest complete checkpoint in `out`, as rank 0 sees it; returns how many steps it had
    done (0 if none)."""
    done = gather(checkpoints(out))[0]  # rank 0 chooses; every rank loads that one
    if not done:
        return 0
    model_sd, optim_sd = get_state_dict(policy, opt)
    path = os.path.join(out, "ckpt", f"step_{done[-1]}", "dcp")
    require_shared(os.path.isdir(path), out, f"cannot see {path}")
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(policy, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return done[-1]


def used_out(out):
    """What a run left in `out`, in words (None: nothing): the last step logged, the newest checkpoint, the
    trained model."""
    metrics = os.path.join(out, "metrics.jsonl")
    logged = [line for line in open(metrics) if line.strip()] if os.path.exists(metrics) else []
    held = [f"metrics.jsonl logged to step {json.loads(logged[-1])['step']}"] if logged else []
    held += [f"the checkpoint ckpt/step_{checkpoints(out)[-1]}"] if checkpoints(out) else []
    held += ["a trained model in model/"] if os.path.isdir(os.path.join(out, "model")) else []
    return "a run: " + ", ".join(held) if held else None


class StopAtStepEnd:
    """SIGTERM (what a scheduler sends before it preempts) or SIGINT (Ctrl-C) ends the run at the next step
    boundary, with a checkpoint. The handler only notes the signal. At each step's end the ranks agree (a
    signal may reach one rank alone; torchrun's agent forwards its own to every worker), then every rank saves
    that step and exits. A second signal exits at once; the newest complete checkpoint stays, since one is
    renamed into place only when whole. A second signal within 2 s of the first is the same stop arriving
    twice (a scheduler that signals every process, and the agent forwarding it) and is not counted."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, out, save_every=0, keep=2, prompts_per_step=None):
        """Checkpoints go to out/ckpt every `save_every` steps (0: only at a stop), the newest `keep` kept;
        prompts_per_step gives each checkpoint's position in the data."""
        self.out, self.save_every, self.keep, self.per_step = out, save_every, keep, prompts_per_step

    def __enter__(self):
        self.got, self.at, self.before = None, 0.0, {}
        if threading.current_thread() is threading.main_thread():  # only there can Python take a signal
            self.before = {s: signal.signal(s, self.note) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.before.items():
            signal.signal(s, handler)

    def note(self, signum, frame):
        """The handler: it records the signal and nothing else (a print here could itself be interrupted)."""
        if self.got and time.monotonic() - self.at >= 2:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # the second signal: the process dies of it, now
        if not self.got:
            self.got, self.at = signal.Signals(signum).name, time.monotonic()

    def signalled(self):
        """Whether any rank has recorded a signal (a signal may reach one rank alone)."""
        return all_reduce_numbers(self.got is not None, op=dist.ReduceOp.MAX)[0] > 0

    def end_of_step(self, done, policy, opt, tok, rank):
        """After step `done`: its checkpoint, every save_every steps or when any rank got a signal; then,
        in the second case, the exit (non-zero, with the way to resume)."""
        stop = self.signalled()
        saving = stop or self.save_every and done % self.save_every == 0
        if saving:
            position = done * self.per_step if self.per_step else None
            save_checkpoint(self.out, done, policy, opt, tok, rank, self.keep, position)
        if saving and not stop:  # a signal during the save: this step's checkpoint is whole, so stop now
            stop = self.signalled()
        if stop:
            path = os.path.join(self.out, "ckpt", f"step_{done}")
            raise SystemExit(1 if rank else f"stapo: stopped by a signal after step {done}, checkpointed in "
                             f"{path}. To continue: the same command with --resume")
