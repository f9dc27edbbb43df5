"""STAPO: Spurious-Token-Aware Policy Optimization (arXiv 2602.15620), the reference trainer.

    torchrun --nproc_per_node 8 stapo.py --model Qwen/Qwen3-8B-Base     (also one CPU process, or several)

The paper's algorithm is stapo_core.py (pure functions, torch only: copy it freely). This file runs it with
FSDP2, read top to bottom: the flags; one step (train_step: Algorithm 1), then what it calls, in the order
it calls it; the weight sync; and main (train). What is not the paper's sits behind a flag and one call: the
token analysis (analysis.py), rollout-IS (rollout_is.py), the in-training evaluation (evaluation.py).
"""
import argparse
import json
import math
import os
from contextlib import closing
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer

from analysis import Later
from checkpoint import StopAtStepEnd, load_checkpoint, save_hf, used_out
from evaluation import BENCHMARKS, PRESETS as EVAL_PRESETS, EvalOptions, evaluate_during_training, longest_prompt
from layers import should_compile
from metrics import Reporter, StepMetrics, append_jsonl, drop_steps_after, provenance, require_reporter
from parallel import (UserError, all_reduce_numbers, check_out, check_shared_out, full_tensor, gather, gather_cat,
                      init_distributed, refuse_used_out, require_model, run_program)
from policy import (TokenStats, build_optimizer, build_policy, head_grad_norm, micro_batches, response_logprobs,
                    shortest_first, token_stats)
from problems import (check_dataset, check_problems, encode_problems, load_problems, probe_tokens, seed_of,
                      step_prompts)
from reward import score_all
from rollout import compute_dtype, engine_kind, make_engine, push_weights, sampler_logprobs
from rollout_is import rollout_is_weights
from stapo_core import group_advantages, quantile, s2t_candidates, s2t_silence, s2t_threshold, stapo_loss


# ---- the flags -----------------------------------------------------------------------------------

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
        ("compile_layers", "auto", "torch.compile of each decoder layer (auto: on CUDA)",
         ["auto", "on", "off"]),
        ("checkpointing", "full", "each decoder layer's activations in the backward: recomputed (full), the "
         "matmuls' and attention's kept and the rest recomputed (selective), or all kept (off: the fastest, "
         "at about twice the update's memory)", ["full", "selective", "off"]),
        ("gpu_memory_utilization", 0.6, "vLLM's share of the GPU while it samples"),
    ],
    "extras (not the paper's)": [
        ("rollout_is", "none", "weigh tokens by pi_old / pi_sampler, per token or per response",
         ["none", "token", "sequence"]),
        ("rollout_is_cap", 2.0, "the rollout-IS weight's cap"),
        ("rollout_is_mode", "truncate", "above the cap: truncate the weight, or mask the token",
         ["truncate", "mask"]),
        ("eval_every", 0, "evaluate every N steps (0: never)"),
        ("eval_preset", "train", "the evaluation's temperature and top-p, one of evaluation.PRESETS (the "
         "paper's two settings; train, eval.py's default: 1.0 and 1.0)", list(EVAL_PRESETS)),
        ("eval_benchmarks", "aime24,math500", "comma list of eval.py's benchmarks"),
        ("eval_max_tokens", 20480, "the evaluation's response limit"),
        ("eval_samples", 0, "samples per problem (0: eval.py's k per benchmark)"),
        ("eval_data_dir", "", "read <benchmark>.jsonl here instead of the Hub"),
    ],
}
SWITCHES = {  # flags that take no value
    "--resume": "continue from the newest checkpoint in --out (none: start fresh)",
    "--log-silenced": "write every silenced token in its context to silenced.jsonl",
    "--analysis": "the token-level analysis: grad_share/* and taxonomy/* in metrics.jsonl (analysis.py)",
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
    run.add_argument("--no-checkpointing", dest="checkpointing", action="store_const", const="off",
                     help="--checkpointing off")
    p.print_usage = lambda file=None: None  # a wrong flag is one line, as any user error (--help lists all)
    return p.parse_args(argv)


# What each number must be (a value outside is refused in one line before anything is read or built)
BOUNDS = [
    ("prompts_per_step", lambda v: v >= 1, "at least 1"), ("group_size", lambda v: v >= 2,
     "at least 2 (GRPO's advantage needs a group's std)"), ("minibatches", lambda v: v >= 1, "at least 1"),
    ("max_prompt_len", lambda v: v >= 1, "at least 1"), ("max_response_len", lambda v: v >= 1, "at least 1"),
    ("temperature", lambda v: v > 0, "above 0 (the loss divides the logits by it)"),
    ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"), ("lr", lambda v: v >= 0, "at least 0"),
    ("warmup_steps", lambda v: v >= 0, "at least 0"), ("weight_decay", lambda v: v >= 0, "at least 0"),
    ("grad_clip", lambda v: v > 0, "above 0"), ("eps_low", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("eps_high", lambda v: v >= 0, "at least 0"), ("clip_c", lambda v: v > 1, "above 1"),
    ("tau_p", lambda v: 0 < v <= 1, "in (0, 1]"), ("q", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("steps", lambda v: v >= 1, "at least 1"), ("save_every", lambda v: v >= 0, "at least 0"),
    ("keep_ckpts", lambda v: v >= 0, "at least 0 (0 keeps them all)"), ("micro_tokens", lambda v: v >= 1,
     "at least 1"), ("gpu_memory_utilization", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("rollout_is_cap", lambda v: v > 0, "above 0"), ("eval_every", lambda v: v >= 0, "at least 0"),
    ("eval_max_tokens", lambda v: v >= 1, "at least 1"), ("eval_samples", lambda v: v >= 0, "at least 0"),
]


def check_args(args):
    """What the flags alone can tell, refused in one line (parallel.UserError) before anything is read, built
    or written: each number in its bounds, --report-to's package installed, --dataset a .jsonl, a .parquet or
    a Hub id, --out a folder that can be made, the in-training evaluation's benchmarks known."""
    for key, ok, must in BOUNDS:
        if not ok(getattr(args, key)):
            raise UserError(f"--{key.replace('_', '-')} {getattr(args, key)}: must be {must}")
    require_reporter(args.report_to)
    check_dataset(args.dataset)
    check_out(args.out)
    if args.eval_every:
        unknown = sorted(set(args.eval_benchmarks.split(",")) - set(BENCHMARKS))
        if unknown:
            raise UserError(f"--eval-benchmarks: unknown {unknown}; choose from {sorted(BENCHMARKS)}")
        if args.eval_data_dir and not os.path.isdir(args.eval_data_dir):
            raise UserError(f"--eval-data-dir {args.eval_data_dir}: no such folder")


# ---- one step: Algorithm 1 ------------------------------------------------------------------------

def train_step(step, policy, opt, engine, tok, prompts, args, device, probe):
    """One step of the paper's loop (Algorithm 1) on this rank's prompts: its row of metrics, and its
    metrics.StepMetrics (what it kept: S2T's set on this rank, in context with --log-silenced)."""
    G, tally = args.group_size, step_metrics(step, tok, args, policy)

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
    tally.rollout([s for g in groups for s in g], batch.rows, rewards, G)

    # 4. The old policy: log p of every sampled token before any update, each mini-batch in the
    #    micro-batches its update will use (same shapes: an unchanged policy gives ratio 1 exactly)
    blocks = split_minibatches(batch.rows, args.minibatches)
    batch.old = TokenStats.zeros(batch.valid.shape, device)
    for idx in blocks:
        batch.old[idx] = token_stats(policy, batch.rows, idx, batch.valid, args.micro_tokens, args.temperature)
    batch.correction, rho = rollout_is_weights(batch.old.logp, batch.sampler, batch.valid, args.rollout_is,
                                           args.rollout_is_cap, args.rollout_is_mode)  # ones unless --rollout-is
    tally.old_policy(batch.valid, batch.old, batch.sampler, rho)

    # 5. Mini-batch updates: S2T on the current policy's p and H, the loss, an optimizer step each
    lr = set_lr(opt, args, step)
    for b, idx in enumerate(blocks):
        train_minibatch(policy, opt, batch, idx, b == 0, args, tally)

    # 6. Sync the engine to the new policy, and prove it
    probe_gap = sync_engine(engine, policy, probe, device)
    tally.peak("sync")
    return tally.finish(lr, probe_gap, G), tally


def step_metrics(step, tok, args, policy):
    """The step's bookkeeping (metrics.StepMetrics): with the silenced tokens' text (--log-silenced) and the
    token-level analysis (--analysis, not the paper's: analysis.py) when asked, and where the layers are
    compiled, a count of the layer calls that ran eager instead (Policy.layers)."""
    analysis = (clip_settings(args), args.tau_p, args.temperature) if args.analysis else None
    return StepMetrics(step, args.method, tok if args.log_silenced else None, analysis,
                       policy.layers if policy.layers.compiled else None)


def revisit(later, step, found, policy, args):
    """--analysis (analysis.Later): keep a sample of this step's S2T set (found, this rank's), and give the
    log p now, at the same context, of the sample kept a few steps ago. A no-grad pass in the trainer's
    micro-batches, the same count on every rank (a rank with nothing due computes one token for nothing)."""
    later.keep(step, found)
    due = later.due(step)
    if not all_reduce_numbers(len(due), op=dist.ReduceOp.MAX)[0]:
        return later.row(0, 0, 0, 0)
    rows = [(prompt, response) for prompt, response, _ in due] or [([0], [0])]
    idx = shortest_first(rows, range(len(rows)))
    R = max(len(r) for _, r in rows)
    device = next(policy.parameters()).device
    valid = torch.arange(R, device=device) < torch.tensor([len(r) for _, r in rows], device=device)[:, None]
    now = token_stats(policy, rows, idx, valid, args.micro_tokens, args.temperature).logp
    now = [float(now[k, len(rows[i][1]) - 1]) for k, i in enumerate(idx)] if due else []
    then = [due[i][2] for i in idx] if due else []
    return later.row(*all_reduce_numbers(len(due), sum(then), sum(now), sum(b > a for a, b in zip(then, now))))


@dataclass
class Batch:
    """One step's samples on this rank, as the trainer holds them: [N, R] tensors over the responses."""
    rows: list                  # (prompt ids, response ids) of each sample
    valid: torch.Tensor         # [N, R] bool: a response token, not padding
    adv: torch.Tensor           # [N] the group advantage of each sample
    sampler: torch.Tensor       # [N, R] the sampler's log p of each token (vLLM reports them), or None
    old: TokenStats = None      # [N, R] log p and H under the policy that sampled (step 4 fills it)
    correction: torch.Tensor = None  # [N, R] each token's rollout-IS factor in the loss: 1 without it (step 4)


def make_batch(prompts, groups, adv, device):
    """The step's samples, padded to the longest response."""
    samples = [s for group in groups for s in group]
    rows = [(p, s.tokens) for (_, p, _), group in zip(prompts, groups) for s in group]
    lengths = torch.tensor([len(s.tokens) for s in samples])
    valid = (torch.arange(max(1, int(lengths.max()))) < lengths[:, None]).to(device)
    return Batch(rows, valid, adv.to(device), sampler_logprobs(samples, valid))


def split_minibatches(rows, count):
    """The step's samples in `count` mini-batches of consecutive prompts, each sorted by length."""
    per = len(rows) // count
    return [shortest_first(rows, range(b * per, (b + 1) * per)) for b in range(count)]


def set_lr(opt, args, step):
    """A linear warm-up over --warmup-steps W, then constant, as verl (JustRL's trainer) steps it once per RL
    step: lr * t / W at step t < W (step 0's updates at lr 0 fill Adam's moments), then lr; returns it."""
    lr = args.lr * (min(1.0, step / args.warmup_steps) if args.warmup_steps > 0 else 1.0)
    for group in opt.param_groups:
        group["lr"] = lr
    return lr


@dataclass
class MiniBatch:
    """What one optimizer step trains on: its samples and each token's scale in the loss."""
    idx: list                   # its samples (rows of the Batch), shortest first
    old_logp: torch.Tensor      # [n, R] log p under the policy that sampled
    adv: torch.Tensor           # [n]
    scale: torch.Tensor         # [n, R] each token's scale in the loss, stapo_loss's keep (0: padded or silenced)
    num_tokens: float           # the kept count over all ranks: the loss's denominator


def train_minibatch(policy, opt, batch, idx, first, args, tally):
    """Step 5 of Algorithm 1 on one mini-batch: the current policy's p and H, S2T (the mask M), each token's
    scale in the loss, an update."""
    old, valid, adv = batch.old[idx], batch.valid[idx], batch.adv[idx]
    if first:  # no update yet: the current policy is the old one
        now = old
    else:
        now = token_stats(policy, batch.rows, idx, batch.valid, args.micro_tokens, args.temperature)
    tally.peak("forward")
    s2t = spurious_tokens(now.logp, now.entropy, adv, valid, args.tau_p, args.q)
    scale, num_tokens = token_scales(args.method, now.entropy, valid, s2t)
    mb = MiniBatch(idx, old.logp, adv, scale * batch.correction[idx], num_tokens)
    norms = update(policy, opt, batch.rows, batch.valid, mb, args, tally)
    tally.minibatch(batch, mb, s2t, now, norms)


class SpuriousTokens(NamedTuple):
    """S2T on a mini-batch (paper: Silencing Spurious Tokens)."""
    candidates: torch.Tensor    # [n, R] valid & (A > 0) & (p < tau_p)
    silenced: torch.Tensor      # [n, R] candidates & (H < tau_h): the mask M
    n_candidates: int           # the candidates on all ranks, whose entropies set tau_h
    tau_h: float | None         # their q-quantile; None where there are none


def spurious_tokens(logp, entropy, adv, valid, tau_p, q):
    """S2T on a mini-batch, with one tau_h over the candidates of all ranks. Computed under every
    objective: STAPO silences these tokens; the token analysis measures them under the others."""
    candidates = s2t_candidates(logp, adv, valid, tau_p)
    pooled = gather_cat(entropy[candidates])
    tau_h = s2t_threshold(pooled, q)
    silenced = s2t_silence(candidates, entropy, tau_h)  # none pooled: none here
    return SpuriousTokens(candidates, silenced, len(pooled), None if tau_h is None else float(tau_h))


def token_scales(method, entropy, valid, s2t):
    """Each token's scale in the loss (stapo_loss's keep: 0 drops it) and the loss's global denominator, for
    each objective the paper compares. Thresholds are computed over the whole mini-batch on all ranks."""
    if method == "grpo":  # token mean per sequence, then mean over sequences
        scale = valid / valid.sum(1, keepdim=True).clamp(min=1)
        return scale, all_reduce_numbers(len(valid))[0]
    if method == "justrl":  # every response token
        scale = valid
    if method == "entropy20":  # the top 20% entropy tokens
        scale = valid & (entropy >= quantile(gather_cat(entropy[valid]), 0.8).to(entropy.device))
    if method == "stapo":  # every response token but the silenced
        scale = valid & ~s2t.silenced
    return scale, all_reduce_numbers(scale.sum())[0]


def clip_settings(args):
    """(eps_low, eps_high, clip_c) of the objective: GRPO clips symmetrically, with no dual clip."""
    if args.method == "grpo":
        return args.eps_low, args.eps_low, None
    return args.eps_low, args.eps_high, args.clip_c


def update(policy, opt, rows, valid, mb, args, tally):
    """One optimizer step on a mini-batch (paper: maximise J_STAPO); returns the gradient's norm and the LM
    head's, before the clip. FSDP2 reduce-scatters the gradients after every micro-batch, so no rank ever
    holds an unsharded gradient of the whole model. A non-finite norm (one bad batch) skips the step, as
    verl does: the norm is global, so every rank skips it, and no NaN reaches the weights."""
    stats, parts = [], micro_batches(rows, mb.idx, args.micro_tokens)  # slices: no index to copy
    for i, (part, idle) in enumerate(parts):
        scale = mb.scale[part] * (not idle)  # an idle micro-batch: one sample, scaled to 0
        logp = response_logprobs(policy, rows, mb.idx[part], valid, args.temperature).logp
        loss, st = stapo_loss(logp, mb.old_logp[part], mb.adv[part], scale, mb.num_tokens, *clip_settings(args))
        policy.set_requires_all_reduce(i == len(parts) - 1)  # several nodes: across them once, after the last
        (loss * dist.get_world_size()).backward()  # FSDP averages over ranks; the loss is global
        stats.append(st)
    tally.loss_stats(stats)  # read once, after the loop: no wait on the device inside it
    tally.peak("backward")
    head = head_grad_norm(policy)
    norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip)
    norm = float(full_tensor(norm))
    if math.isfinite(norm):
        opt.step()
    else:
        tally.skipped(norm)
    opt.zero_grad(set_to_none=True)
    tally.peak("optimizer")
    return norm, head


# ---- the weight sync -----------------------------------------------------------------------------

# The sync's self-check: mean and largest |engine log p - trainer log p| over problems.PROBE's tokens.
# bf16: measured on vLLM's CPU build, set against published GPU gaps (docs/training.md: the self-check).
SYNC_TOLERANCE = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (0.1, 2.0)}


@torch.no_grad()
def sync_engine(engine, policy, probe, device):
    """Push the policy's weights into the engine, then prove twice that the engine computes what the trainer
    does: the weights it computes with are, part by part, bit for bit those pushed (a digest,
    rollout.push_weights: a stale, partial or mis-mapped sync fails there, in bf16 as in fp32), and its
    log-probs of a fixed probe sequence match the trainer's (an engine that holds the right weights but
    computes with something else fails here). Returns the probe gaps' mean and max."""
    push_weights(engine, policy.lm)
    rows = [(probe[:1], probe[1:])]
    valid = torch.ones(1, len(probe) - 1, dtype=torch.bool, device=device)
    want = response_logprobs(policy, rows, [0], valid, 1.0).logp[0]
    policy.reshard()  # the root (embeddings, lm_head) would stay gathered through the rollout
    gap = (torch.tensor(engine.logprobs_of(probe), device=device) - want).abs()
    mean, largest = float(gap.mean()), float(gap.max())
    tolerance = SYNC_TOLERANCE[engine.dtype]
    if not (mean <= tolerance[0] and largest <= tolerance[1]):
        raise RuntimeError(f"engine weight sync: the engine's log-probs of the probe differ from "
                           f"the trainer's by {mean:.3g} on average, {largest:.3g} at most; the "
                           f"tolerance is {tolerance} (a stale, partial or mis-mapped sync)")
    return mean, largest


# ---- main ----------------------------------------------------------------------------------------

def context_length(args, tok):
    """The engine's context: a training prompt and response, and with --eval-every the longest
    eval prompt and --eval-max-tokens (vLLM would silently stop an answer at its context); a
    length beyond the model's own positions is refused."""
    need = {"--max-prompt-len + --max-response-len": args.max_prompt_len + args.max_response_len}
    if args.eval_every:
        longest = longest_prompt(tok, args.eval_benchmarks.split(","), eval_options(args))
        need["the longest eval prompt + --eval-max-tokens"] = longest + args.eval_max_tokens
    limit = getattr(AutoConfig.from_pretrained(args.model), "max_position_embeddings", None)
    for what, n in need.items():
        if limit and n > limit:
            raise UserError(f"{what} is {n} tokens, beyond the {limit} positions of --model {args.model}")
    return max(need.values())


def eval_options(args):
    """--eval-every's evaluation: --eval-preset's temperature and top-p, the --eval-* settings."""
    temperature, top_p = EVAL_PRESETS[args.eval_preset]
    return EvalOptions(args.eval_samples or None, temperature, top_p, args.eval_max_tokens,
                       args.eval_data_dir or None, chat_template=args.chat_template,
                       enable_thinking=args.enable_thinking, seed=args.seed)


def train(args):
    # What the flags and files can tell is refused in one line before anything is built or written
    check_args(args)
    require_model(args.model)
    rank, world, device, mesh = init_distributed()
    if args.prompts_per_step % (args.minibatches * world):
        raise UserError(f"--prompts-per-step {args.prompts_per_step} must split evenly into "
                        f"--minibatches {args.minibatches}, each over {world} ranks")
    if args.rollout_is != "none" and engine_kind(args.engine, device) == "hf":
        raise UserError(f"--rollout-is {args.rollout_is} weighs by the sampler's log-probs, which the HF engine "
                        "does not report: --engine vllm")
    if not args.resume:
        refuse_used_out(args.out, used_out(args.out), "Continue it with --resume, or start anew in another --out")
    tok = AutoTokenizer.from_pretrained(args.model)
    problems = load_problems(args.dataset)
    data = encode_problems(tok, problems, args.max_prompt_len, args.chat_template, args.enable_thinking)
    check_problems(data, args.dataset, len(problems) - len(data), args.max_prompt_len)
    context, dtype = context_length(args, tok), compute_dtype(args.dtype, device)
    probe = probe_tokens(tok, context - 1, args.chat_template)  # the sync's self-check
    check_shared_out(args.out, rank)  # the first write to --out
    if rank == 0:
        dropped = len(problems) - len(data)
        note = f" ({dropped} dropped: longer than --max-prompt-len)" if dropped else ""
        print(f"stapo: --method {args.method}, {args.model} on {world} rank(s) ({device.type}), {len(data)} "
              f"problems{note}, --out {args.out}", flush=True)
    compiled = should_compile(args.compile_layers, device)
    policy = build_policy(args.model, mesh, device, dtype, compiled, args.checkpointing)
    policy.collision = args.analysis  # --analysis: the no-grad passes give sum pi^2 too (analysis.py)
    opt = build_optimizer(policy, args.lr, args.weight_decay)
    start = load_checkpoint(policy, opt, args.out) if args.resume else 0
    logs = [os.path.join(args.out, name) for name in ("metrics.jsonl", "silenced.jsonl")]
    config = {**vars(args), "world_size": world, "mesh": list(mesh.shape), "device": str(device),
              "problems": len(data), "provenance": provenance()}
    if rank == 0:
        with open(os.path.join(args.out, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
        for path in logs:
            drop_steps_after(path, start)
        reporter = Reporter(args.report_to, args.out, config)
    progress = dict(desc="stapo", initial=start, total=args.steps, disable=rank != 0)
    stop_at_step_end = StopAtStepEnd(args.out, args.save_every, args.keep_ckpts, args.prompts_per_step)
    later = Later()  # --analysis: a sample of each step's S2T set, revisited a few steps on
    engine = make_engine(args.engine, args.model, tok, device, context, args.gpu_memory_utilization,
                         dtype=dtype)
    # The engine closes on every exit from here, a failed first sync's included; a signal: a checkpoint at
    # the step's end, then the exit
    with closing(engine), stop_at_step_end as stop:
        sync_engine(engine, policy, probe, device)  # vLLM's dummy weights become the (resumed) policy's
        for step in tqdm(range(start, args.steps), **progress):
            prompts = step_prompts(data, step, args.prompts_per_step, args.minibatches, args.seed, rank,
                                   world)
            metrics, tally = train_step(step, policy, opt, engine, tok, prompts, args, device, probe)
            if args.analysis:  # not the paper's: what became of S2T's set of a few steps ago
                metrics.update(revisit(later, step, tally.found, policy, args))
            if args.eval_every and (step + 1) % args.eval_every == 0:
                names = args.eval_benchmarks.split(",")
                metrics.update(evaluate_during_training(engine, tok, names, eval_options(args), rank, world))
            silenced = sum(gather(tally.silenced), [])
            if rank == 0:
                append_jsonl(logs[0], [metrics])
                reporter.log(metrics)
                if silenced:
                    append_jsonl(logs[1], silenced)
                shown = ("step", "reward_mean", "accuracy", "silenced_frac", "response_len_mean",
                         "entropy_mean", "grad_norm", "step_s")
                tqdm.write(" ".join(f"{k}={metrics[k]:.4g}" for k in shown))
            stop.end_of_step(step + 1, policy, opt, tok, rank)  # a checkpoint; after a signal, the exit
        save_hf(policy, tok, os.path.join(args.out, "model"), rank)
        dist.barrier()  # the last collective: the engine's close, on any exit, destroys vLLM's process group
    return policy


if __name__ == "__main__":
    run_program(lambda: train(get_args()))
