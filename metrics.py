"""metrics.py: what a step measures, and where it goes. Each step's metrics (rewards, lengths, S2T's counts,
clip fractions, the paper's token-level analysis, time and memory peaks) as one row of metrics.jsonl, and to
W&B or TensorBoard when asked; the silenced tokens in their context, to silenced.jsonl.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from parallel import all_reduce_numbers

GROUPS = [f"{p}P_{a}A_{h}H" for p in ("low", "high") for a in ("pos", "neg") for h in ("low", "high")]
SHARES = ("silenced", "candidates_kept", "rest")
SUMS = ("samples", "correct", "reward", "flat_groups", "tokens", "valid", "entropy", "truncated",
        "gap_n", "gap", "silenced", "kept", "clip_low", "clip_high", "is_n", "is_sum",
        *[f"g2/{k}" for k in SHARES], *[f"{g}/{k}" for g in GROUPS for k in ("n", "norm", "dH")])


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
    """One step's bookkeeping. Per-rank counts are summed over ranks once, in finish(); the S2T
    numbers and grad norms are already global (the same on every rank) and are kept as they are."""

    def __init__(self, step, tok=None):
        self.step, self.tok, self.silenced = step, tok, []  # with a tokenizer, silenced tokens are kept
        self.sums = dict.fromkeys(SUMS, 0.0)
        self.candidates, self.tau_h, self.grad_norm, self.entropy_cut = 0, [], [], []
        self.is_min, self.is_max, self.peaks = float("inf"), float("-inf"), {}
        self.t0 = time.time()

    def add(self, **counts):
        for key, value in counts.items():
            self.sums[key] += float(value)

    def peak(self, phase):
        """The memory high-water mark of a phase of the step (rollout, forward, backward...). The first,
        rollout, runs from the previous step's sync (or the start): logging, checkpoints, eval included."""
        self.peaks[phase] = max(self.peaks.get(phase, 0.0), memory_peak())

    def rollout(self, samples, rows, rewards, group_size):
        self.add(samples=len(samples), correct=(rewards > 0).sum(), reward=rewards.sum(),
                 flat_groups=(rewards.view(-1, group_size).std(1) == 0).sum(),
                 tokens=sum(len(p) + len(r) for p, r in rows),
                 truncated=sum(s.finish_reason == "length" for s in samples))
        self.longest = max(len(s.tokens) for s in samples)
        self.t_rollout = time.time() - self.t0
        self.peak("rollout")

    def old_policy(self, batch):
        """The old policy's entropy; |sampler log p - trainer log p| (it jumps if a sync breaks)."""
        valid, old_ent = batch.valid, batch.old_stats[..., 0]
        gap = torch.zeros(0) if batch.sampler is None else (batch.sampler - batch.old_logp)[valid].abs()
        self.add(valid=valid.sum(), entropy=old_ent[valid].sum())
        self.add(gap_n=gap.numel(), gap=gap.sum())
        self.gap_max = float(gap.max()) if gap.numel() else 0.0
        self.peak("old_policy")

    def importance(self, rho):
        """--rollout-is: the ratios pi_old / pi_sampler (per token, or per response)."""
        self.add(is_n=rho.numel(), is_sum=rho.sum())
        self.is_min = min(self.is_min, float(rho.min()))
        self.is_max = max(self.is_max, float(rho.max()))

    def loss_stats(self, st):
        """stapo_loss's clip fractions, as counts (a rank's micro-batches differ in size)."""
        kept = st["kept"]
        self.add(kept=kept, clip_low=st["clip_low"] * kept, clip_high=st["clip_high"] * kept)

    def minibatch(self, method, s2t, grad_norm, rows, idx):
        self.grad_norm.append(grad_norm)
        self.add(silenced=s2t["silenced"].sum() if method == "stapo" else 0)
        self.candidates += s2t["pooled"]
        self.tau_h += [s2t["tau_h"]] if s2t["tau_h"] is not None else []
        if self.tok is not None and method == "stapo":
            self.silenced += silenced_records(self.step, self.tok, rows, idx, s2t)

    def analysis(self, tokens, s2t, cut):
        """The paper's token-level view of a mini-batch, as sums over this rank's tokens: the share
        of sum ||grad_a||^2 held by S2T's silenced tokens (under another objective: those STAPO
        would silence), by its other candidates, and by the rest; and the eight groups, p (vs
        tau_p) x sign A x H (vs the entropy cut). tokens: low_p, adv, entropy, valid, norm, dH."""
        low_p, adv, ent, valid, norm, change = tokens
        parts = [s2t["silenced"], s2t["candidates"] & ~s2t["silenced"], valid & ~s2t["candidates"]]
        self.add(**{f"g2/{k}": norm[m].square().sum() for k, m in zip(SHARES, parts)})
        self.entropy_cut.append(cut)
        low_h = ent < cut
        masks = [p & s & h for p in (low_p, ~low_p) for s in (adv > 0, adv < 0) for h in (low_h, ~low_h)]
        for g, m in zip(GROUPS, masks):
            m = m & valid
            self.add(**{f"{g}/n": m.sum(), f"{g}/norm": norm[m].sum(), f"{g}/dH": change[m].sum()})

    def finish(self, lr, probe_gap, group_size):
        """The step's row of metrics.jsonl (the same on every rank), and this rank's silenced tokens."""
        n = dict(zip(SUMS, all_reduce_numbers(*self.sums.values())))
        longest, gap_max, is_max = all_reduce_numbers(self.longest, self.gap_max, self.is_max,
                                                      op=dist.ReduceOp.MAX)
        is_min = all_reduce_numbers(self.is_min, op=dist.ReduceOp.MIN)[0]
        peaks = all_reduce_numbers(*self.peaks.values(), op=dist.ReduceOp.MAX)
        step_s = time.time() - self.t0
        row = {"step": self.step + 1, **rollout_row(n, longest, group_size), **s2t_row(self, n)}
        row.update(grad_norm=sum(self.grad_norm) / len(self.grad_norm), lr=lr)
        row.update(sync_row(n, gap_max, probe_gap))
        row.update(rollout_s=self.t_rollout, train_s=step_s - self.t_rollout, step_s=step_s,
                   tokens_per_s=n["tokens"] / step_s)
        if n["is_n"]:
            row.update(rollout_is_min=is_min, rollout_is_mean=n["is_sum"] / n["is_n"], rollout_is_max=is_max)
        row.update(analysis_row(n, self.entropy_cut))
        row.update({f"peak_gb/{phase}": gb for phase, gb in zip(self.peaks, peaks)})
        row.update(taxonomy_row(n))
        return row, self.silenced


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


def analysis_row(n, cuts):
    total = sum(n[f"g2/{k}"] for k in SHARES)
    row = {f"grad_share/{k}": n[f"g2/{k}"] / total if total else None for k in SHARES}
    row["entropy_cut"] = sum(cuts) / len(cuts)
    return row


def taxonomy_row(n):
    """Each group's share of the tokens, mean gradient norm and mean entropy change."""
    row, tokens = {}, sum(n[f"{g}/n"] for g in GROUPS)
    for g in GROUPS:
        k = n[f"{g}/n"]
        row[f"taxonomy/{g}/tokens"] = k / tokens if tokens else 0.0
        row[f"taxonomy/{g}/grad_norm"] = n[f"{g}/norm"] / k if k else None
        row[f"taxonomy/{g}/dH"] = n[f"{g}/dH"] / k if k else None
    return row


def silenced_records(step, tok, rows, idx, s2t):
    """One record per silenced token: the token, its p and H, and 40 characters either side."""
    records, logp, ent = [], s2t["logp"], s2t["entropy"]
    for i, t in s2t["silenced"].nonzero().tolist():
        response = rows[idx[i]][1]
        records.append({
            "step": step + 1,
            "token": tok.decode(response[t:t + 1]),
            "p": logp[i, t].exp().item(),
            "H": ent[i, t].item(),
            "left": tok.decode(response[:t])[-40:],
            "right": tok.decode(response[t + 1:])[:40],
        })
    return records


def append_jsonl(path, records):
    with open(path, "a") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)


def drop_steps_after(path, step):
    """Cut a log back to the checkpoint's step: a resumed run re-runs (and re-logs) the steps after it."""
    if os.path.exists(path):
        kept = [line for line in open(path) if json.loads(line)["step"] <= step]
        with open(path, "w") as f:
            f.writelines(kept)


class Reporter:
    """--report-to: each step's metrics also go to W&B or TensorBoard (imported only if asked)."""

    def __init__(self, kind, out, config):
        self.kind = kind
        if kind == "wandb":
            import wandb
            self.run = wandb.init(dir=out, config=config)
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


