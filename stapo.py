"""STAPO: Spurious-Token-Aware Policy Optimization (arXiv 2602.15620), the reference trainer.

Read top to bottom: first the algorithm as pure functions that need only torch (copy them
freely), then the trainer that runs them with FSDP2: `torchrun --nproc_per_node 8 stapo.py`.

The paper's recipe is JustRL's (GRPO group advantages, clip-higher, dual clip, token-mean loss,
no KL, no entropy bonus) plus the S2T mask, which silences the rare "spurious" tokens: tokens of
correct answers (A > 0) that the policy gave a low probability (p < tau_p) at a low-entropy
position (H < tau_h).
"""
import argparse
import json
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer

from checkpoint import StopAtStepEnd, load_checkpoint, save_hf, used_out
from eval import PRESETS as EVAL_PRESETS, evaluate_during_training, longest_prompt
from metrics import Reporter, StepMetrics, append_jsonl, drop_steps_after
from parallel import all_reduce_numbers, check_shared_out, gather, gather_cat, init_distributed, refuse_used_out
from policy import build_policy, measure, micro_batches, response_logprobs
from problems import encode_problems, load_problems, probe_tokens, seed_of, step_prompts
from reward import score_all
from rollout import compute_dtype, full_params, make_engine, sampler_logprobs


# ==== The algorithm: pure functions, torch only ===================================================

def group_advantages(rewards, group_size, eps=1e-6):
    """GRPO advantages (paper: group-normalised advantage A_i = (r_i - mean(r)) / (std(r) + eps)).

    rewards: [N], rows k*G .. k*G+G-1 are the G samples of prompt k. std is the unbiased torch.std.
    A group whose rewards are all equal gets exactly A = 0 (it carries no learning signal).
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (one sample has no std), got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be [N] with N a multiple of group_size={group_size}, "
                         f"got {tuple(rewards.shape)}")
    r = rewards.float().view(-1, group_size)
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)
    return adv.masked_fill((r == r[:, :1]).all(1, keepdim=True), 0.0).view(-1)


def quantile(x, q):
    """torch.quantile(x, q) with linear interpolation, in x's own precision and for any length
    (torch.quantile refuses more than 2**24 values, and a float64 threshold must stay float64)."""
    if x.numel() == 0:
        raise ValueError("quantile of an empty tensor")
    s = x.flatten().sort().values
    pos = q * (s.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, s.numel() - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def s2t_candidates(logp, adv, valid, tau_p=0.002):
    """S2T's candidates: valid & (A > 0) & (p < tau_p), a bool [N, T]. adv: [N], [N, 1] or [N, T].
    A fresh or tiny model makes many: p ~ 1/V is already below tau_p for any V > 500."""
    adv = adv if adv.dim() == logp.dim() else adv[:, None]
    return valid.bool() & (adv > 0) & (logp.exp() < tau_p)


def s2t_threshold(candidate_entropies, q=0.75):
    """tau_h, the q-quantile of the candidates' entropies (pass every rank's, gathered, for one
    threshold over a data-parallel mini-batch); None when there are no candidates anywhere."""
    if candidate_entropies.numel() == 0:
        return None
    return quantile(candidate_entropies, q)


def s2t_mask(logp, entropy, adv, valid, tau_p=0.002, q=0.75, tau_h=None):
    """The S2T mask (paper: Silencing Spurious Tokens, M_{i,t}). A bool [N, T], True = silenced.

    logp, entropy: [N, T] log-prob of each sampled token and the full-vocabulary entropy (nats) of
    the policy at that position, both detached. adv: [N], [N, 1] or [N, T]. valid: [N, T] mask.
        candidates C = valid & (A > 0) & (p < tau_p)            s2t_candidates
        tau_h = q-quantile of H over C      (linear interpolation, in H's precision; s2t_threshold)
        silenced = C & (H < tau_h)          (no candidate: nothing silenced)
    A given tau_h overrides the quantile. Data-parallel, one threshold over every rank's tokens:
        h = entropy[s2t_candidates(logp, adv, valid, tau_p)]      # this rank's candidates
        tau_h = s2t_threshold(all_gather_cat(h), q)              # your framework's gather
        silenced = s2t_mask(logp, entropy, adv, valid, tau_p, q, tau_h)
    """
    candidates = s2t_candidates(logp, adv, valid, tau_p)
    if tau_h is None:
        tau_h = s2t_threshold(entropy[candidates], q)
    if tau_h is None:
        return candidates
    return candidates & (entropy < tau_h)


def stapo_loss(logp, old_logp, adv, keep, num_tokens=None, eps_low=0.2, eps_high=0.28, clip_c=10.0,
               max_log_ratio=20.0):
    """The STAPO objective (paper: J_STAPO), as a loss to minimise. Returns (loss, stats).

    Shapes: logp, old_logp, keep are [N, T] (padded batch) or [M] (packed tokens); adv is [N],
    [N, 1] or [N, T] for a padded batch, [M] for packed tokens. logp carries the gradient; old_logp
    and adv are constants (detached here). Inputs of any float dtype are computed in float32.
        ratio = exp(clamp(logp - old_logp, +-max_log_ratio))   (verl clamps at 20: no inf, no NaN)
        l = max(-ratio * A, -clip(ratio, 1 - eps_low, 1 + eps_high) * A)
        l = min(l, -clip_c * A) where A < 0                    (dual clip, verl's; None: off)
        loss = sum(l * keep) / num_tokens                      (num_tokens defaults to keep.sum())
    keep = valid & ~silenced (bool or 0/1), so the loss is renormalised over the tokens neither
    padded nor silenced; a float keep is a weight (GRPO's 1/|o_i|, whose sum is the number of
    sequences). Silenced and padded tokens get exactly zero gradient; num_tokens = 0 gives 0.
    With keep = valid, clip_c=None and max_log_ratio=float("inf") this is exactly DAPO's
    token-mean loss (TRL's loss_type="dapo"); the dual clip and the clamp change only A < 0 tokens
    with ratio > clip_c, and log-ratios beyond +-20.
    The contract, for a trainer of your own:
      - p and H (s2t_mask's inputs) come from the policy of this optimizer step, for the step's
        whole batch on all ranks, before its first backward; under gradient accumulation that is
        one no-grad forward over the batch (exact when the policy moves once per batch).
      - num_tokens is the kept count of the whole optimizer step on all ranks, the same number for
        every micro-batch of it (gradient accumulation must not divide again).
      - Data parallel: a wrapper that averages gradients over W ranks (DDP, FSDP, accelerate, TRL)
        needs num_tokens = global kept / W, or the loss multiplied by W (what stapo.py does).
    """
    if logp.dim() not in (1, 2) or old_logp.shape != logp.shape or keep.shape != logp.shape:
        raise ValueError(f"stapo_loss: logp, old_logp, keep must share one shape [N, T] or [M]; "
                         f"got {tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(keep.shape)}")
    per_row = logp.dim() == 2 and adv.shape in (logp.shape[:1], (logp.shape[0], 1))
    if adv.shape != logp.shape and not per_row:
        raise ValueError(f"stapo_loss: adv must be [N], [N, 1] or [N, T] (padded logp), [M] (packed "
                         f"logp); got adv {tuple(adv.shape)} for logp {tuple(logp.shape)}")
    adv = adv.detach().float()
    adv = (adv if adv.dim() == logp.dim() else adv[:, None]).expand_as(logp)
    kept = keep > 0
    log_ratio = (logp.float() - old_logp.detach().float()).clamp(-max_log_ratio, max_log_ratio)
    ratio = torch.where(kept, log_ratio, 0.0).exp()
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    per_token = torch.maximum(-ratio * adv, -clipped * adv)
    if clip_c is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -clip_c * adv), per_token)
    per_token = torch.where(kept, per_token, 0.0) * keep
    n = float(keep.sum() if num_tokens is None else num_tokens)
    if n < 0:
        raise ValueError(f"stapo_loss: num_tokens must be >= 0, got {n}")
    loss = per_token.sum() / n if n > 0 else per_token.sum() * 0.0
    with torch.no_grad():
        k = max(int(kept.sum()), 1)
        stats = {"clip_low": float((kept & (adv < 0) & (ratio < 1 - eps_low)).sum()) / k,
                 "clip_high": float((kept & (adv > 0) & (ratio > 1 + eps_high)).sum()) / k,
                 "kept": int(kept.sum())}
    return loss, stats


def rollout_is_weights(old_logp, sampler_logp, valid, level="token", cap=2.0, mode="truncate"):
    """Weights against the sampler-trainer mismatch (not the paper's; stapo.py --rollout-is). In bf16
    the sampler's kernels give other log-probs than the trainer's for the same weights:
        rho = pi_old(y) / pi_sampler(y)     per token, or per response (level="sequence": the product)
        w = min(rho, cap)                   (mode="truncate", TIS)
        w = rho if rho <= cap else 0        (mode="mask")
    Returns (w [N, T], zero at padding: a factor on keep; rho [N, T] or [N, 1], for the logs)."""
    log_rho = (old_logp - sampler_logp).masked_fill(~valid.bool(), 0.0)
    if level == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True)
    w = log_rho.clamp(max=math.log(cap)).exp()
    if mode == "mask":
        w = w.masked_fill(log_rho > math.log(cap), 0.0)
    return w.expand_as(old_logp) * valid, log_rho.double().exp()


def loss_token_weight(logp, old_logp, adv, keep, num_tokens=None, eps_low=0.2, eps_high=0.28, clip_c=10.0,
                      max_log_ratio=20.0):
    """d stapo_loss / d logp of each token (paper: the token's term of grad J_STAPO), for the same arguments:
    the loss's gradient on the token's logits is this weight times (e_y - pi) / T. No graph.
        -A * ratio * keep / num_tokens   where the unclipped term is the live one:
                                           A > 0 and ratio <= 1 + eps_high            (clip-higher)
                                           A < 0 and 1 - eps_low <= ratio <= clip_c   (clip, dual clip)
                                           and |log ratio| <= max_log_ratio           (the clamp)
        0                                elsewhere: a clip or the clamp holds the term, A = 0, keep = 0
    """
    adv = (adv if adv.dim() == logp.dim() else adv[:, None]).float().expand_as(logp)
    log_ratio = logp.detach().float() - old_logp.detach().float()
    ratio = log_ratio.clamp(-max_log_ratio, max_log_ratio).exp()
    upper = torch.where(adv > 0, 1 + eps_high, math.inf if clip_c is None else clip_c)
    lower = torch.where(adv > 0, 0.0, 1 - eps_low)
    live = (keep > 0) & (ratio >= lower) & (ratio <= upper) & (log_ratio.abs() <= max_log_ratio)
    n = float(keep.sum() if num_tokens is None else num_tokens)
    return torch.where(live, -adv * ratio * keep / n, 0.0) if n > 0 else torch.zeros_like(ratio)


def logit_gradient_norm(logp, collision, weight, temperature=1.0):
    """||d (w log pi_y) / d a|| of each token, a its logits, pi = softmax(a / T) (the paper's identity, with
    w = A): ||grad||^2 = w^2 (1 - 2 pi_y + sum_n pi_n^2) / T^2, sum pi^2 >= exp(-H). With w the loss's own
    weight (loss_token_weight) it is the norm of the gradient the loss applies there."""
    return weight.abs() / temperature * (1 - 2 * logp.exp() + collision).clamp(min=0).sqrt()


def entropy_change(logp, entropy, weight):
    """The paper's lemma: the first-order change of H at a token's position under a natural-gradient step,
    logit_y += eta * w (w = A in the paper), per unit eta: dH = -w pi_y (log pi_y + H). (A plain gradient
    step on the logits, a += eta * w (e_y - pi), changes H by -eta w (pi_y (log pi_y + H) - sum_n pi_n^2
    (log pi_n + H)) instead; BAPO's form carries a factor 1 - pi_y.)"""
    return -weight * logp.exp() * (logp + entropy)


# ==== The trainer: torchrun stapo.py --model ... (also one CPU process, or several under gloo) ====

# Every setting is a flag; `python stapo.py --help` lists them in four groups. Each default of the first
# group says whose it is: (paper) STAPO's own, (JustRL) the recipe STAPO builds on and keeps, (ours) where
# this trainer departs from the paper (--reward only). The defaults of the other groups are ours, but for
# the in-training evaluation's, which are eval.py's.
FLAGS = {
    "the paper's settings (README: The paper's settings)": [
        ("method", "stapo", "the objective; the others are the paper's baselines (paper)",
         ["stapo", "justrl", "grpo", "entropy20"]),
        ("model", "Qwen/Qwen3-8B-Base", "the policy, a Hub id or a folder (paper: 1.7B, 8B, 14B Base)"),
        ("dataset", "BytedTsinghua-SIA/DAPO-Math-17k", "a Hub id, .jsonl or .parquet (paper)"),
        ("prompts_per_step", 256, "prompts per step (JustRL)"),
        ("group_size", 8, "samples per prompt, G (JustRL)"),
        ("minibatches", 4, "optimizer updates per step (JustRL)"),
        ("max_prompt_len", 1024, "longer prompts are dropped (JustRL)"),
        ("max_response_len", 15360, "the longest response, in tokens (JustRL)"),
        ("temperature", 1.0, "sampling temperature; the loss divides logits by it too (JustRL)"),
        ("top_p", 1.0, "sampling top-p (JustRL)"),
        ("lr", 1e-6, "AdamW's learning rate, constant after the warm-up (JustRL)"),
        ("warmup_steps", 10, "linear warm-up, in steps (JustRL)"),
        ("weight_decay", 0.1, "AdamW's weight decay (JustRL)"),
        ("grad_clip", 1.0, "the gradient norm's cap (JustRL)"),
        ("eps_low", 0.2, "clip-higher's lower epsilon (JustRL)"),
        ("eps_high", 0.28, "clip-higher's upper epsilon (JustRL)"),
        ("clip_c", 10.0, "the dual clip's c, for A < 0 tokens (JustRL)"),
        ("tau_p", 0.002, "S2T: a candidate's probability is below this (paper)"),
        ("q", 0.75, "S2T: tau_h is this quantile of the candidates' entropies (paper)"),
        ("reward", "equiv", "+1 when the last box is equivalent to the gold (ours); dapo: the box "
         "string-equal to the gold, DAPO's reward, the paper's (reward.dapo_score)", ["equiv", "dapo"]),
    ],
    "the run": [
        ("out", "runs/stapo", "the run's folder: config, metrics.jsonl, checkpoints, the model"),
        ("steps", 1000, "steps to train (ours; the paper's curves run past 3,000)"),
        ("seed", 0, "the run's seed: data order and every sample's seed"),
        ("save_every", 50, "a checkpoint every N steps (0: none)"),
        ("keep_ckpts", 2, "the newest N checkpoints are kept"),
        ("report_to", "none", "also send each step's metrics to W&B or TensorBoard",
         ["none", "wandb", "tensorboard"]),
    ],
    "engines and precision": [
        ("engine", "auto", "the sampler: vLLM, or a transformers decode loop (auto: vLLM on CUDA)",
         ["auto", "vllm", "hf"]),
        ("dtype", "auto", "compute and engine dtype (auto: bf16 on CUDA, fp32 on CPU)",
         ["auto", "bf16", "fp32"]),
        ("micro_tokens", 16384, "padded tokens per forward and backward"),
        ("gpu_memory_utilization", 0.6, "vLLM's share of the GPU while it samples"),
    ],
    "extras (not the paper's)": [
        ("rollout_is", "none", "weigh tokens by pi_old / pi_sampler, per token or per response",
         ["none", "token", "sequence"]),
        ("rollout_is_cap", 2.0, "the rollout-IS weight's cap"),
        ("rollout_is_mode", "truncate", "above the cap: truncate the weight, or mask the token",
         ["truncate", "mask"]),
        ("eval_every", 0, "evaluate every N steps (0: never)"),
        ("eval_preset", "train", "the evaluation's temperature and top-p, one of eval.PRESETS (the paper's "
         "two settings; train, eval.py's default: 1.0 and 1.0)", list(EVAL_PRESETS)),
        ("eval_benchmarks", "aime24,math500", "comma list of eval.py's benchmarks"),
        ("eval_max_tokens", 20480, "the evaluation's response limit"),
        ("eval_samples", 0, "samples per problem (0: eval.py's k per benchmark)"),
        ("eval_data_dir", "", "read <benchmark>.jsonl here instead of the Hub"),
    ],
}
SWITCHES = {  # flags that take no value
    "--resume": "continue from the newest checkpoint in --out (none: start fresh)",
    "--log-silenced": "write every silenced token in its context to silenced.jsonl",
    "--enable-thinking": "Qwen3's chat template in thinking mode",
}


def get_args(argv=None):
    p = argparse.ArgumentParser(description="The STAPO trainer (arXiv 2602.15620).")
    for title, flags in FLAGS.items():
        group = p.add_argument_group(title)
        for key, default, text, *choices in flags:
            group.add_argument("--" + key.replace("_", "-"), type=type(default), default=default,
                               choices=choices[0] if choices else None, help=f"{text}; default {default}")
    run = p.add_argument_group("switches")
    for flag, text in SWITCHES.items():
        run.add_argument(flag, action="store_true", help=text)
    run.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                     help="the prompt as plain text, not a user turn of the chat template")
    return p.parse_args(argv)


# ---- one step ------------------------------------------------------------------------------------

@dataclass
class Batch:
    """One step's samples on this rank, as the trainer holds them: [N, R] tensors over the responses."""
    rows: list                  # (prompt ids, response ids) of each sample
    valid: torch.Tensor         # [N, R] bool: a response token, not padding
    adv: torch.Tensor           # [N] the group advantage of each sample
    sampler: torch.Tensor       # [N, R] the sampler's log p of each token (vLLM), or None
    old_logp: torch.Tensor      # [N, R] log p under the policy that sampled (step 4 fills it)
    old_stats: torch.Tensor     # [N, R, 2] the head's statistics there: H, sum pi^2


def make_batch(prompts, groups, adv, device):
    """The step's samples, padded to the longest response."""
    samples = [s for group in groups for s in group]
    rows = [(p, s.tokens) for (_, p, _), group in zip(prompts, groups) for s in group]
    lengths = torch.tensor([len(s.tokens) for s in samples])
    valid = (torch.arange(max(1, int(lengths.max()))) < lengths[:, None]).to(device)
    old = torch.zeros(valid.shape, device=device)
    stats = torch.zeros(*valid.shape, 2, device=device)
    return Batch(rows, valid, adv.to(device), sampler_logprobs(samples, valid), old, stats)


def spurious_tokens(logp, ent, adv, valid, args):
    """S2T on a mini-batch, with one tau_h over the candidates of all ranks. Computed under every
    objective: STAPO silences these tokens; the token analysis measures them under the others."""
    candidates = s2t_candidates(logp, adv, valid, args.tau_p)
    pooled = gather_cat(ent[candidates])
    tau_h = s2t_threshold(pooled, args.q)
    silenced = s2t_mask(logp, ent, adv, valid, args.tau_p, args.q, tau_h)  # none pooled: none here
    tau_h = None if tau_h is None else float(tau_h)
    return {"candidates": candidates, "silenced": silenced, "pooled": len(pooled), "tau_h": tau_h,
            "logp": logp, "entropy": ent}


def token_weights(method, ent, valid, s2t):
    """Per-token weights `keep` and their global denominator, for each objective the paper
    compares. Thresholds are computed over the whole mini-batch on all ranks."""
    if method == "grpo":  # token mean per sequence, then mean over sequences
        keep = valid / valid.sum(1, keepdim=True).clamp(min=1)
        return keep, all_reduce_numbers(len(valid))[0]
    if method == "justrl":  # every response token
        keep = valid
    if method == "entropy20":  # the top 20% entropy tokens
        keep = valid & (ent >= quantile(gather_cat(ent[valid]), 0.8).to(ent.device))
    if method == "stapo":  # every response token but the silenced
        keep = valid & ~s2t["silenced"]
    return keep, all_reduce_numbers(keep.sum())[0]


def clip_settings(args):
    """(eps_low, eps_high, clip_c) of the objective: GRPO clips symmetrically, with no dual clip."""
    if args.method == "grpo":
        return args.eps_low, args.eps_low, None
    return args.eps_low, args.eps_high, args.clip_c


@dataclass
class MiniBatch:
    idx: list                   # its samples (rows of the Batch), shortest first
    keep: torch.Tensor          # [n, R] each token's weight in the loss (0: padded or silenced)
    denom: float                # the kept count over all ranks: the loss's denominator


def update(policy, opt, batch, mb, args, record):
    """One optimizer step on a mini-batch. FSDP2 reduce-scatters the gradients after every
    micro-batch, so no rank ever holds an unsharded gradient of the whole model."""
    keep = torch.zeros(batch.valid.shape, dtype=mb.keep.dtype, device=batch.valid.device)
    keep[mb.idx] = mb.keep
    for micro in micro_batches(batch.rows, mb.idx, args.micro_tokens):
        sel = micro or mb.idx[:1]  # an empty micro-batch runs one sample at zero weight
        logp, _ = response_logprobs(policy, batch.rows, sel, batch.valid, args.temperature)
        loss, st = stapo_loss(logp, batch.old_logp[sel], batch.adv[sel], keep[sel] * bool(micro), mb.denom,
                              *clip_settings(args))
        (loss * dist.get_world_size()).backward()  # FSDP averages over ranks; the loss is global
        record.loss_stats(st)
    record.peak("backward")
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    record.peak("optimizer")
    return float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)


def train_minibatch(policy, opt, batch, idx, first, args, record):
    """Step 5 on one mini-batch: p and H under the policy as it is now, S2T, the loss, a step."""
    if first:  # no update yet: the current policy is the old one
        logp, stats = batch.old_logp[idx], batch.old_stats[idx]
    else:
        logp, stats = measure(policy, batch.rows, idx, batch.valid, args)
    record.peak("forward")
    s2t = spurious_tokens(logp, stats[..., 0], batch.adv[idx], batch.valid[idx], args)
    keep, denom = token_weights(args.method, stats[..., 0], batch.valid[idx], s2t)
    unsilenced = batch.valid[idx].float() if args.method == "stapo" else keep  # S2T's set kept: the analysis
    if args.rollout_is != "none":  # the mismatch's weights multiply the kept tokens' losses
        w, rho = rollout_is_weights(batch.old_logp[idx], batch.sampler[idx], batch.valid[idx],
                                    args.rollout_is, args.rollout_is_cap, args.rollout_is_mode)
        keep, unsilenced = keep * w, unsilenced * w
        record.importance(rho if args.rollout_is == "sequence" else rho[batch.valid[idx]])
    mb = MiniBatch(idx, keep, denom)
    analyse(logp, stats, batch, mb, unsilenced, s2t, args, record)
    grad_norm = update(policy, opt, batch, mb, args, record)
    record.minibatch(args.method, s2t, grad_norm, batch.rows, idx)


def analyse(logp, stats, batch, mb, unsilenced, s2t, args, record):
    """The paper's token-level view of a mini-batch, for metrics.TokenAnalysis to sum: the norm of the
    gradient the loss applies to each token's logits, and of the one it would apply with S2T's set kept
    (`unsilenced`: keep with those tokens back); each token's policy-gradient norm and entropy change
    (the paper's identity and lemma, with w = ratio * A, before the clips and S2T)."""
    ent, collision = stats.unbind(-1)
    old, adv = batch.old_logp[mb.idx], batch.adv[mb.idx, None].expand_as(logp)
    norm = lambda w: logit_gradient_norm(logp, collision, w, args.temperature)  # noqa: E731
    applied, if_kept = (loss_token_weight(logp, old, adv, k, mb.denom, *clip_settings(args))
                        for k in (mb.keep, unsilenced))
    weight = (logp - old).exp() * adv  # ratio * A
    tokens = (norm(applied), norm(if_kept), norm(weight), entropy_change(logp, ent, weight))
    record.analysis.add(s2t, logp.exp() < args.tau_p, adv, batch.valid[mb.idx], tokens)


def train_step(step, policy, opt, engine, tok, prompts, args, device, probe):
    """One step of the paper's loop (Algorithm 1) on this rank's prompts: (metrics, silenced)."""
    G, record = args.group_size, StepMetrics(step, tok if args.log_silenced else None)

    # 1. Rollout: G samples per prompt from the engine (the policy as of the last sync), each seeded
    seeds = [seed_of(args.seed, step, g) for g, _, _ in prompts]
    groups = engine.generate([p for _, p, _ in prompts], G, args.temperature, args.top_p,
                             args.max_response_len, seeds)
    engine.sleep()

    # 2. Reward: +1 if the last \boxed{} is right (--reward: equivalent to the gold, or DAPO's), else -1
    texts = tok.batch_decode([s.tokens for group in groups for s in group], skip_special_tokens=True)
    rewards = torch.tensor(score_all(texts, [a for _, _, a in prompts for _ in range(G)], args.reward))

    # 3. Advantages: normalised within each group of G
    batch = make_batch(prompts, groups, group_advantages(rewards, G), device)
    record.rollout([s for g in groups for s in g], batch.rows, rewards, G)

    # 4. The old policy: log p of every sampled token before any update, each mini-batch in the
    #    micro-batches its update will use (same shapes: an unchanged policy gives ratio 1 exactly)
    blocks = minibatches(batch.rows, args.minibatches)
    for idx in blocks:
        batch.old_logp[idx], batch.old_stats[idx] = measure(policy, batch.rows, idx, batch.valid, args)
    record.old_policy(batch)

    # 5. Mini-batch updates: S2T on the current policy's p and H, the loss, an optimizer step each
    lr = set_lr(opt, args, step)
    for b, idx in enumerate(blocks):
        train_minibatch(policy, opt, batch, idx, b == 0, args, record)

    # 6. Sync the engine to the new policy, and prove it
    probe_gap = sync_engine(engine, policy, probe, device)
    record.peak("sync")
    return record.finish(lr, probe_gap, G)


def minibatches(rows, count):
    """The step's samples in `count` mini-batches of consecutive prompts, each sorted by length."""
    per = len(rows) // count
    by_length = lambda i: len(rows[i][0]) + len(rows[i][1])  # noqa: E731
    return [sorted(range(b * per, (b + 1) * per), key=by_length) for b in range(count)]


def set_lr(opt, args, step):
    """A linear warm-up over --warmup-steps, then constant; returns the step's lr."""
    lr = args.lr * min(1.0, (step + 1) / max(1, args.warmup_steps))
    for group in opt.param_groups:
        group["lr"] = lr
    return lr


# ---- the weight sync -----------------------------------------------------------------------------

# The sync's self-check: mean and largest |engine log p - trainer log p| over problems.PROBE's tokens.
# bf16: measured on vLLM's CPU build, set against published GPU gaps (docs/training.md: the self-check).
SYNC_TOLERANCE = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (0.1, 2.0)}


@torch.no_grad()
def sync_engine(engine, policy, probe, device):
    """Push the policy's weights into the engine, then prove the engine computes what the trainer
    does: its log-probs of a fixed probe sequence must match the trainer's (a stale, partial or
    mis-mapped sync fails here, even a copy the engine reads back right but never samples with).
    Returns the gaps' mean and max."""
    engine.load_weights(full_params(policy.lm, engine.dtype))
    rows = [(probe[:1], probe[1:])]
    valid = torch.ones(1, len(probe) - 1, dtype=torch.bool, device=device)
    want, _ = response_logprobs(policy, rows, [0], valid, 1.0)
    policy.reshard()  # the root (embeddings, lm_head) would stay gathered through the rollout
    gap = (torch.tensor(engine.logprobs_of(probe), device=device) - want[0]).abs()
    mean, top = float(gap.mean()), float(gap.max())
    tolerance = SYNC_TOLERANCE[engine.dtype]
    if not (mean <= tolerance[0] and top <= tolerance[1]):
        raise RuntimeError(f"engine weight sync: the engine's log-probs of the probe differ from "
                           f"the trainer's by {mean:.3g} on average, {top:.3g} at most; the "
                           f"tolerance is {tolerance} (a stale, partial or mis-mapped sync)")
    return mean, top


# ---- main ----------------------------------------------------------------------------------------

def context_length(args, tok):
    """The engine's context: a training prompt and response, and with --eval-every the longest
    eval prompt and --eval-max-tokens (vLLM would silently stop an answer at its context); a
    length beyond the model's own positions is refused."""
    need = {"--max-prompt-len + --max-response-len": args.max_prompt_len + args.max_response_len}
    if args.eval_every:
        need["the longest eval prompt + --eval-max-tokens"] = longest_prompt(tok, args) + args.eval_max_tokens
    limit = getattr(AutoConfig.from_pretrained(args.model), "max_position_embeddings", None)
    for what, n in need.items():
        if limit and n > limit:
            raise ValueError(f"{what} is {n} tokens, beyond the {limit} positions of --model {args.model}")
    return max(need.values())


def train(args):
    rank, world, device, mesh = init_distributed()
    if args.prompts_per_step % (args.minibatches * world):
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} must split evenly into "
                         f"--minibatches {args.minibatches}, each over {world} ranks")
    if not args.resume:  # before anything is written to --out
        refuse_used_out(args.out, used_out(args.out), "Continue it with --resume, or start anew in another --out")
    check_shared_out(args.out, rank)
    tok = AutoTokenizer.from_pretrained(args.model)
    problems = load_problems(args.dataset)
    data = encode_problems(tok, problems, args.max_prompt_len, args.chat_template, args.enable_thinking)
    context, dtype = context_length(args, tok), compute_dtype(args.dtype, device)
    probe = probe_tokens(tok, context - 1, args.chat_template)  # the sync's self-check
    policy = build_policy(args.model, mesh, device, dtype)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay, foreach=True)
    start = load_checkpoint(policy, opt, args) if args.resume else 0
    engine = make_engine(args.engine, args.model, tok, device, context, args.gpu_memory_utilization,
                         dtype=dtype)
    sync_engine(engine, policy, probe, device)  # vLLM's dummy weights become the (resumed) policy's
    logs = [os.path.join(args.out, name) for name in ("metrics.jsonl", "silenced.jsonl")]
    config = {**vars(args), "world_size": world, "mesh": list(mesh.shape), "device": str(device),
              "problems": len(data)}
    if rank == 0:
        with open(os.path.join(args.out, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
        for path in logs:
            drop_steps_after(path, start)
        reporter = Reporter(args.report_to, args.out, config)
    progress = dict(desc="stapo", initial=start, total=args.steps, disable=rank != 0)
    with StopAtStepEnd() as stop:  # SIGTERM or SIGINT: a checkpoint at the step's end, then the exit
        for step in tqdm(range(start, args.steps), **progress):
            prompts = step_prompts(data, step, args, rank, world)
            metrics, silenced = train_step(step, policy, opt, engine, tok, prompts, args, device, probe)
            if args.eval_every and (step + 1) % args.eval_every == 0:
                metrics.update(evaluate_during_training(engine, tok, args, rank, world))
            silenced = sum(gather(silenced), [])
            if rank == 0:
                append_jsonl(logs[0], [metrics])
                reporter.log(metrics)
                if silenced:
                    append_jsonl(logs[1], silenced)
                shown = ("step", "reward_mean", "accuracy", "silenced_frac", "response_len_mean",
                         "entropy_mean", "grad_norm", "step_s")
                tqdm.write(" ".join(f"{k}={metrics[k]:.4g}" for k in shown))
            stop.end_of_step(step + 1, policy, opt, tok, args, rank)  # a checkpoint; after a signal, the exit
    save_hf(policy, tok, os.path.join(args.out, "model"), rank)
    dist.barrier()
    return policy


if __name__ == "__main__":
    try:
        train(get_args())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
