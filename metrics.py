"""metrics.py: what a step measures, and where it goes. Each step's metrics (rewards, lengths, S2T's counts,
clip fractions, the token-level analysis when on, time and memory peaks) as one row of metrics.jsonl, and to
W&B or TensorBoard when asked; the silenced tokens in their context, to silenced.jsonl.
"""
import importlib
import json
import os
import platform
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from analysis import KEYS, TokenAnalysis
from parallel import UserError, all_reduce_numbers

SUMS = ("samples", "correct", "reward", "flat_groups", "tokens", "valid", "entropy", "truncated",
        "gap_n", "gap", "silenced", "kept", "clip_low", "clip_high", "is_n", "is_sum")


def memory_peak():
    """GiB, and reset: on CUDA the trainer's peak allocation (torch's, less what vLLM holds in its own
    pool), on CPU the process's peak resident set (Linux), each since the previous call."""
    if torch.cuda.is_available():
        gb = (torch.cuda.max_memory_allocated() - vllm_pool_bytes()) / 2**30
        torch.cuda.reset_peak_memory_stats()
        return gb
    with open("/proc/self/status") as f:
        gb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from the resident set now
    return gb


def vllm_pool_bytes():
    """The bytes torch has allocated in the segments of vLLM's CuMem pool: sleep mode's weights, KV cache
    and buffers, which torch's counters include, asleep or awake (sleeping unmaps, and frees nothing)."""
    cumem = sys.modules.get("vllm.device_allocator.cumem")  # imported by an engine with sleep mode
    allocator = cumem.CuMemAllocator.instance if cumem else None
    if allocator is None:
        return 0
    ours = allocator.pointer_to_data  # a segment's address -> vLLM's allocation there
    return sum(s["allocated_size"] for s in torch.cuda.memory_snapshot() if s["address"] in ours)


class StepMetrics:
    """One step's bookkeeping. Per-rank counts are summed over ranks once, in finish(); the S2T numbers, the
    grad norms and the skipped updates are already global (the same on every rank) and are kept as they are.
    tok: the silenced tokens are kept in their context; analysis: the token-level view's settings (clip,
    tau_p, temperature: analysis.TokenAnalysis), or None; layers: the policy's layers.Layers where its
    decoder layers are compiled (the step counts the calls that ran eager instead), or None."""

    def __init__(self, step, method, tok=None, analysis=None, layers=None):
        self.step, self.method, self.tok, self.silenced = step, method, tok, []
        self.sums = dict.fromkeys(SUMS, 0.0)
        self.analysis = TokenAnalysis(method, *analysis) if analysis else None
        self.analysed = dict.fromkeys(KEYS, 0.0) if analysis else {}
        self.candidates, self.tau_h, self.norms, self.peaks, self.skips, self.found = 0, [], [], {}, 0, []
        self.is_min, self.is_max, self.t0 = float("inf"), float("-inf"), time.time()
        self.seconds, self.mark = {}, self.t0  # each phase's seconds, and where the current one began
        self.longest, self.gap_max, self.t_rollout = 0, 0.0, 0.0  # the longest response, the largest gap
        self.layers, self.eager_from = layers, layers.eager_calls if layers else None

    def add(self, **counts):
        accumulate(self.sums, counts)

    def peak(self, phase):
        """The end of a phase of the step (rollout, old_policy, forward, backward, optimizer, sync): its memory
        high-water mark, and its seconds, summed over its calls (a mini-batch's forward, backward and optimizer
        phases come once per update), the device synchronised first (a wait a phase, a few a step). The first,
        rollout, runs from the previous step's sync (or the start): logging, checkpoints, eval included."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.time()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.mark
        self.peaks[phase] = max(self.peaks.get(phase, 0.0), memory_peak())
        self.mark = now

    def rollout(self, samples, rows, rewards, group_size):
        self.add(samples=len(samples), correct=(rewards > 0).sum(), reward=rewards.sum(),
                 flat_groups=(rewards.view(-1, group_size).std(1) == 0).sum(),
                 tokens=sum(len(p) + len(r) for p, r in rows),
                 truncated=sum(s.finish_reason == "length" for s in samples))
        self.longest, self.t_rollout = max(len(s.tokens) for s in samples), time.time() - self.t0
        self.peak("rollout")

    def old_policy(self, valid, old, sampler, rho):
        """The old policy's entropy (old: its TokenStats); |sampler log p - trainer log p| (it jumps if a sync
        breaks; sampler None: the engine reports no log-probs); --rollout-is's ratios pi_old / pi_sampler, per
        token or per response (none without it)."""
        gap = torch.zeros(0) if sampler is None else (sampler - old.logp)[valid].abs()
        self.add(valid=valid.sum(), entropy=old.entropy[valid].sum(), gap_n=gap.numel(), gap=gap.sum(),
                 is_n=rho.numel(), is_sum=rho.sum())
        self.gap_max = float(gap.max()) if gap.numel() else 0.0
        if rho.numel():
            self.is_min, self.is_max = float(rho.min()), float(rho.max())
        self.peak("old_policy")

    def loss_stats(self, stats):
        """An update's stapo_loss statistics, one dict of tensors per micro-batch, read from the device at
        once: the clip fractions as counts (a rank's micro-batches differ in size)."""
        counts = torch.stack([torch.stack([st[k].double() for k in ("kept", "clip_low", "clip_high")])
                              for st in stats])
        for kept, low, high in counts.tolist():
            self.add(kept=kept, clip_low=low * kept, clip_high=high * kept)

    def skipped(self, norm):
        """An update skipped: its gradient norm was not finite (the weights stay as they were). The norm is
        global, so every rank skips it and counts it once."""
        self.skips += 1
        if dist.get_rank() == 0:
            print(f"step {self.step + 1}: the gradient norm is {norm}; this update is skipped",
                  file=sys.stderr)

    def minibatch(self, batch, mb, s2t, now, norms):
        """A mini-batch's update (mb: stapo.MiniBatch, of the step's stapo.Batch): its gradient norms, S2T's
        counts (s2t: stapo.SpuriousTokens, judged by the TokenStats now), its silenced tokens, and with
        --analysis the token-level view."""
        self.norms.append(norms)  # the update's gradient norms: the whole model's, the LM head's
        self.add(silenced=s2t.silenced.sum() if self.method == "stapo" else 0)
        self.candidates += s2t.n_candidates
        self.tau_h += [s2t.tau_h] if s2t.tau_h is not None else []
        if self.tok is not None:
            self.silenced += silenced_records(self.step, self.tok, batch.rows, mb.idx, s2t.silenced, now,
                                              self.method == "stapo")
        if self.analysis:  # --analysis (not the paper's): measures the mini-batch, changes nothing
            valid, correction = batch.valid[mb.idx], batch.correction[mb.idx]
            sums = self.analysis.sums(now, mb.old_logp, mb.adv, valid, mb.scale, mb.num_tokens, s2t, correction)
            accumulate(self.analysed, sums)
            rows = [batch.rows[mb.idx[i]] + (t, lp) for i, t, lp in spurious_positions(s2t.silenced, now.logp)]
            self.found += rows  # for analysis.Later: what becomes of them

    def finish(self, lr, probe_gap, group_size):
        """The step's row of metrics.jsonl (the same on every rank)."""
        n, analysed, most, is_min = over_ranks(self)
        grad, head = zip(*self.norms)
        row = {"step": self.step + 1, **rollout_row(n, most["longest"], group_size), **s2t_row(self, n),
               "lr": lr, "grad_norm": sum(grad) / len(grad), "lm_head_grad_norm": list(head),
               "skipped_updates": self.skips}
        peaks = {phase: most[f"peak_gb/{phase}"] for phase in self.peaks}
        seconds = {phase: most[f"seconds/{phase}"] for phase in self.seconds}
        row.update(sync_row(n, most["gap_max"], probe_gap), **resources_row(self, n["tokens"], peaks, seconds))
        row.update(importance_row(n, is_min, most["is_max"]))
        row.update(self.analysis.row(analysed) if self.analysis else {})
        row.update(layers_row(self, most["eager_layer_calls"]) if self.layers else {})
        return row


def over_ranks(m):
    """A step's sums over all ranks (its own and the analysis's), its maxima by name (the longest response,
    the largest gap and rollout-IS ratio, each phase's memory peak) and the smallest rollout-IS ratio."""
    summed = all_reduce_numbers(*m.sums.values(), *m.analysed.values())
    eager = m.layers.eager_calls - m.eager_from if m.layers else 0
    maxima = {"longest": m.longest, "gap_max": m.gap_max, "is_max": m.is_max, "eager_layer_calls": eager,
              **{f"peak_gb/{phase}": gb for phase, gb in m.peaks.items()},
              **{f"seconds/{phase}": t for phase, t in m.seconds.items()}}
    most = dict(zip(maxima, all_reduce_numbers(*maxima.values(), op=dist.ReduceOp.MAX)))
    is_min = all_reduce_numbers(m.is_min, op=dist.ReduceOp.MIN)[0]
    return dict(zip(SUMS, summed)), dict(zip(m.analysed, summed[len(SUMS):])), most, is_min


def accumulate(sums, counts):
    """sums[key] += each count, as a Python float (a tensor's .item())."""
    for key, value in counts.items():
        sums[key] += float(value)


def rollout_row(n, longest, group_size):
    """What the samples were: rewards, accuracy, lengths, groups with no signal."""
    return {
        "reward_mean": n["reward"] / n["samples"],
        "accuracy": n["correct"] / n["samples"],
        "zero_variance_groups": n["flat_groups"] * group_size / n["samples"],
        "response_len_mean": n["valid"] / n["samples"],
        "response_len_max": int(longest),
        "truncated": n["truncated"] / n["samples"],
        "entropy_mean": n["entropy"] / max(n["valid"], 1),
    }


def s2t_row(m, n):
    """What S2T and the clips did: the silenced fraction, the candidates, tau_h, the clip fractions."""
    return {
        "silenced_frac": n["silenced"] / max(n["valid"], 1),
        "candidates": m.candidates,
        "tau_h": sum(m.tau_h) / len(m.tau_h) if m.tau_h else None,
        "clip_low": n["clip_low"] / max(n["kept"], 1),
        "clip_high": n["clip_high"] / max(n["kept"], 1),
    }


def sync_row(n, gap_max, probe_gap):
    """The sampler-trainer gap over the step's tokens, and the sync's probe gap."""
    return {
        "logprob_gap_mean": n["gap"] / n["gap_n"] if n["gap_n"] else None,
        "logprob_gap_max": gap_max if n["gap_n"] else None,
        "sync_probe_gap_mean": probe_gap[0],
        "sync_probe_gap": probe_gap[1],
    }


def resources_row(m, tokens, peaks, seconds):
    """The rollout's, the training's and the step's seconds, tokens per second, each phase's memory peak and
    seconds (the largest over ranks)."""
    step_s = time.time() - m.t0
    row = {"rollout_s": m.t_rollout, "train_s": step_s - m.t_rollout, "step_s": step_s,
           "tokens_per_s": tokens / step_s}
    return {**row, **{f"peak_gb/{phase}": gb for phase, gb in peaks.items()},
            **{f"seconds/{phase}": t for phase, t in seconds.items()}}


def layers_row(m, eager):
    """Compiled layers: the decoder-layer calls of the step that ran eager on the rank with the most (0 when
    every call ran compiled), and one line on stderr when some did."""
    if eager and dist.get_rank() == 0:
        print(f"step {m.step + 1}: {int(eager)} decoder-layer calls ran eager although the layers are compiled "
              "(a graph that failed to compile, or dynamo's recompile limit; eager_layer_calls in "
              "metrics.jsonl counts them); --compile-layers off runs all eager", file=sys.stderr)
    return {"eager_layer_calls": int(eager)}


def importance_row(n, is_min, is_max):
    """--rollout-is: the ratios' min, mean and max (nothing without it)."""
    if not n["is_n"]:
        return {}
    return {"rollout_is_min": is_min, "rollout_is_mean": n["is_sum"] / n["is_n"], "rollout_is_max": is_max}


def silenced_records(step, tok, rows, idx, s2t_set, now, silenced):
    """One record per token of S2T's set (silenced under stapo, trained on under the others): the token, its
    position t in the response, its p and H (now: the TokenStats S2T judged by), and 40 characters either
    side."""
    records, logp, ent = [], now.logp, now.entropy
    for i, t in s2t_set.nonzero().tolist():
        response = rows[idx[i]][1]
        records.append({
            "step": step + 1,
            "token": tok.decode(response[t:t + 1]),
            "t": t,
            "p": logp[i, t].exp().item(),
            "H": ent[i, t].item(),
            "silenced": silenced,
            "left": tok.decode(response[:t])[-40:],
            "right": tok.decode(response[t + 1:])[:40],
        })
    return records


def spurious_positions(s2t_set, logp):
    """(row, position, log p) of each token of S2T's set, [n, R] mask and log-probs, read once."""
    at = s2t_set.nonzero()
    return [(i, t, lp) for (i, t), lp in zip(at.tolist(), logp[s2t_set].tolist())]


def append_jsonl(path, records):
    with open(path, "a") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)


def drop_steps_after(path, step):
    """Cut a log back to the checkpoint's step: a resumed run re-runs (and re-logs) the steps after it."""
    if os.path.exists(path):
        kept = [line for line in open(path) if json.loads(line)["step"] <= step]
        with open(path, "w") as f:
            f.writelines(kept)


REPORTERS = {"wandb": ("wandb", "wandb"), "tensorboard": ("torch.utils.tensorboard", "tensorboard")}


def require_reporter(kind):
    """--report-to's package, imported (as Reporter will), or a one-line UserError naming what to install."""
    if kind in REPORTERS:
        module, package = REPORTERS[kind]
        try:
            importlib.import_module(module)
        except ImportError:
            raise UserError(f"--report-to {kind} needs the {package} package: pip install {package}") from None


class Reporter:
    """--report-to: each step's metrics also go to W&B or TensorBoard (imported only if asked; require_reporter
    first, before the model loads). The W&B run is named for --out, in the project $WANDB_PROJECT (else
    stapo), and keeps its id in <out>/wandb_id: --resume continues that W&B run."""

    def __init__(self, kind, out, config):
        self.kind = kind
        if kind == "wandb":
            import wandb
            path = os.path.join(out, "wandb_id")
            run_id = open(path).read().strip() if os.path.exists(path) else os.urandom(8).hex()
            with open(path, "w") as f:
                f.write(run_id)
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "stapo"), name=os.path.basename(
                os.path.abspath(out)), id=run_id, resume="allow", dir=out, config=config)
        if kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(os.path.join(out, "tensorboard"))

    def log(self, metrics):
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if self.kind == "wandb":
            self.run.log(numbers, step=metrics["step"])
        if self.kind == "tensorboard":
            for key, value in numbers.items():
                self.writer.add_scalar(key, value, metrics["step"])
            self.writer.flush()


def provenance(root=os.path.dirname(os.path.abspath(__file__))):
    """What a run or a measurement ran on: the commit (git's, or STAPO_COMMIT where the tree travelled without
    .git), whether the tree had uncommitted changes (None: unknown), the machine (CPU model, cores, GPU) and
    the command line."""
    def git(*argv):
        try:
            return subprocess.run(["git", "-C", root, *argv], capture_output=True, text=True, timeout=30,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    commit, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"commit": commit or os.environ.get("STAPO_COMMIT"), "dirty": None if status is None else bool(status),
            "cpu": cpu, "cores": os.cpu_count(), "gpu": gpu, "torch": torch.__version__,
            "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
