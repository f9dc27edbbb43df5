"""STAPO: Spurious-Token-Aware Policy Optimization (arXiv 2602.15620), the reference trainer.

Read top to bottom: first the algorithm as four pure functions that need only torch (copy them freely),
then the trainer that runs them with FSDP2 under torchrun:

    torchrun --nproc_per_node 8 stapo.py --model Qwen/Qwen3-8B

The paper's recipe is JustRL's (GRPO group advantages, clip-higher, dual clip, token-mean loss, no KL,
no entropy bonus) plus the S2T mask, which silences the rare "spurious" tokens: tokens of correct answers
(A > 0) that the policy gave a low probability (p < tau_p) at a low-entropy position (H < tau_h).
"""
import torch


# ==== The algorithm: pure functions, torch only ========================================================

def group_advantages(rewards, group_size, eps=1e-6):
    """GRPO advantages (paper: group-normalised advantage A_i = (r_i - mean(r)) / (std(r) + eps)).

    rewards: [N], rows k*G .. k*G+G-1 are the G samples of prompt k. std is the unbiased torch.std.
    A group whose rewards are all equal gets exactly A = 0 (it carries no learning signal).
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (the std of one sample is undefined), got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be [N] with N a multiple of group_size={group_size}, got {tuple(rewards.shape)}")
    r = rewards.float().view(-1, group_size)
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)
    return adv.masked_fill((r == r[:, :1]).all(1, keepdim=True), 0.0).view(-1)


def s2t_mask(logp, entropy, adv, valid, tau_p=0.002, q=0.75, tau_h=None):
    """The S2T mask (paper: Silencing Spurious Tokens, M_{i,t}). Returns a bool [N, T], True = silenced.

    logp, entropy: [N, T] log-prob of each sampled token and the full-vocabulary entropy (nats) of the
    policy at that position, both detached. adv: [N] or [N, T]. valid: [N, T] response mask.
    Candidates C = valid & (A > 0) & (p < tau_p); tau_h = q-quantile of H over C (linear interpolation);
    silenced = C & (H < tau_h). An empty C silences nothing. A given tau_h overrides the quantile, so a
    trainer can pass one threshold computed over a whole mini-batch on all ranks.
    """
    adv = adv if adv.dim() == 2 else adv[:, None]
    cand = valid.bool() & (adv > 0) & (logp.exp() < tau_p)
    if tau_h is None:
        if not cand.any():
            return cand
        tau_h = torch.quantile(entropy[cand].float(), q)
    return cand & (entropy < tau_h)


def stapo_loss(logp, old_logp, adv, keep, num_tokens=None, eps_low=0.2, eps_high=0.28, clip_c=10.0):
    """The STAPO objective (paper: J_STAPO), as a loss to minimise. Returns (loss, stats).

    Per token: ratio = exp(logp - old_logp); l = max(-ratio*A, -clip(ratio, 1-eps_low, 1+eps_high)*A),
    and for A < 0 also l = min(l, -clip_c*A) (dual clip, as verl; clip_c=None turns it off).
    loss = sum(l * keep) / num_tokens, where keep = valid & ~silenced and num_tokens defaults to
    keep.sum(): the loss is renormalised over the tokens that are neither padding nor silenced.

    With nothing silenced (keep = valid) this is exactly the DAPO/JustRL token-mean loss.
    keep may also be a float weight per token (the trainer's GRPO baseline passes 1/|o_i|).
    Silenced and padded tokens get exactly zero gradient, and an all-silenced batch a finite zero loss.
    """
    adv = (adv if adv.dim() == 2 else adv[:, None]).expand_as(logp)
    kept = keep > 0
    ratio = torch.where(kept, logp - old_logp, 0.0).exp()  # masked before exp: padding cannot overflow
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    per_token = torch.maximum(-ratio * adv, -clipped * adv)
    if clip_c is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -clip_c * adv), per_token)
    per_token = torch.where(kept, per_token, 0.0) * keep
    n = kept.sum() if num_tokens is None else num_tokens
    loss = per_token.sum() / max(float(n), 1.0)
    with torch.no_grad():
        k = max(int(kept.sum()), 1)
        stats = {"clip_low": float((kept & (adv < 0) & (ratio < 1 - eps_low)).sum()) / k,
                 "clip_high": float((kept & (adv > 0) & (ratio > 1 + eps_high)).sum()) / k,
                 "kept": int(kept.sum())}
    return loss, stats


class _ChunkedHead(torch.autograd.Function):
    """log p(token) and H from hidden states, one [chunk, V] fp32 logits buffer at a time.

    The backward recomputes each chunk's logits (activation checkpointing by hand) and applies the
    log-softmax gradient d log p_y / d z = (onehot(y) - softmax(z)) / T, so [M, V] never exists.
    """

    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, chunk_size):
        logp, entropy, logz = (hidden.new_empty(hidden.shape[0], dtype=torch.float32) for _ in range(3))
        for i in range(0, hidden.shape[0], chunk_size):
            j = slice(i, i + chunk_size)
            z = (hidden[j] @ weight.T).float().div_(temperature)
            logz[j] = z.logsumexp(-1)
            z.sub_(logz[j, None])  # z is now log p, in place
            logp[j] = z.gather(-1, tokens[j, None]).squeeze(-1)
            entropy[j] = -(z.exp().mul_(z)).sum(-1)  # H = -sum p log p
        ctx.save_for_backward(hidden, weight, tokens, logz)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, tokens, logz = ctx.saved_tensors
        grad_h, grad_w = torch.empty_like(hidden), torch.zeros_like(weight)
        for i in range(0, hidden.shape[0], ctx.chunk_size):
            j = slice(i, i + ctx.chunk_size)
            z = (hidden[j] @ weight.T).float().div_(ctx.temperature)
            g = z.sub_(logz[j, None]).exp_().mul_(-grad_logp[j, None])  # -g * softmax(z)
            g = g.scatter_add_(-1, tokens[j, None], grad_logp[j, None]).div_(ctx.temperature).to(weight.dtype)
            grad_h[j] = g @ weight
            grad_w.addmm_(g.T, hidden[j])
        return grad_h, grad_w, None, None, None


def token_logprobs_and_entropy(hidden, weight, tokens, temperature=1.0, chunk_size=128):
    """Log-prob (with grad) and entropy (no grad, nats) of each sampled token, from decoder hidden states.

    hidden: [M, D] the final hidden state before each token; weight: [V, D] the lm_head weight;
    tokens: [M] the sampled ids. Logits are divided by the sampling temperature, as the sampler did.
    Works in chunks of tokens, so the [M, V] logits (let alone their fp32 log-softmax) never exist;
    equal to log_softmax(hidden @ weight.T / T) gathered at tokens, in values and gradients.
    """
    return _ChunkedHead.apply(hidden, weight, tokens, float(temperature), chunk_size)


# ==== The trainer: torchrun stapo.py --model ... (also one CPU process, or several under gloo) ==========
import argparse, json, os, random, shutil, time  # noqa: E402

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

SUFFIX = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_SUFFIX = "\n\nRemember to put your answer on its own line after \"Answer:\"."


# Every setting is a flag (--prompts-per-step 256 ...); the defaults are the paper's: JustRL's recipe + S2T.
CONFIG = dict(
    model="Qwen/Qwen3-8B", dataset="BytedTsinghua-SIA/DAPO-Math-17k", out="runs/stapo", method="stapo",
    steps=1000, prompts_per_step=256, group_size=8, minibatches=4, micro_tokens=16384,       # batch shape
    max_prompt_len=1024, max_response_len=15360, temperature=1.0, top_p=1.0,                  # rollout
    lr=1e-6, warmup_steps=10, weight_decay=0.1, grad_clip=1.0,                                 # AdamW
    eps_low=0.2, eps_high=0.28, clip_c=10.0,                                                   # clip-higher, dual clip
    tau_p=0.002, q=0.75,                                                                       # S2T
    engine="auto", gpu_memory_utilization=0.6, save_every=50, seed=0,
    eval_every=0, eval_benchmarks="aime24,math500", eval_samples=4, eval_data_dir="")
CHOICES = {"method": ["stapo", "justrl", "grpo", "entropy20"], "engine": ["auto", "vllm", "hf"]}


def get_args(argv=None):
    p = argparse.ArgumentParser(description="STAPO trainer. The defaults are the paper's (README: Settings).")
    for key, default in CONFIG.items():
        p.add_argument("--" + key.replace("_", "-"), type=type(default), default=default, choices=CHOICES.get(key))
    for flag in ("--resume", "--log-silenced", "--enable-thinking"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--no-chat-template", dest="chat_template", action="store_false")
    return p.parse_args(argv)


# ---- distribution -------------------------------------------------------------------------------------

def init_distributed():
    """torchrun's env (or a lone process): returns rank, world size, device, a 1-D device mesh."""
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:  # a plain `python stapo.py`: a world of one (port 0: the OS picks a free one)
            dist.init_process_group(backend, init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device, init_device_mesh(device.type, (dist.get_world_size(),))


def all_sum(*xs):
    t = torch.tensor([float(x) for x in xs], dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def gather(obj):
    """Every rank's obj, in rank order."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def gather_cat(x):
    """Concatenate a 1-D tensor of any length from every rank."""
    return torch.cat(gather(x.float().cpu()))


# ---- data ---------------------------------------------------------------------------------------------

def read_jsonl(path, fields=()):
    """[(\"file:line\", row)] of a .jsonl file; a line that is not a JSON object, or lacks one of `fields`,
    is an error naming the file, the line and the field."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
            missing = [k for k in fields if not isinstance(row, dict) or row.get(k) is None]
            if not isinstance(row, dict) or missing:
                raise ValueError(f"{path}:{i}: " + (f"missing field {missing[0]!r}" if missing else "not an object"))
            rows.append((f"{path}:{i}", row))
    return rows


def _problem_answer(row, where):
    if "prompt" not in row:
        missing = [k for k in ("problem", "answer") if row.get(k) is None]
        if missing:
            raise ValueError(f"{where}: missing field {missing[0]!r}")
        return row["problem"], str(row["answer"])
    try:  # DAPO-Math-17k's own schema: the problem inside its instruction wrapper, the gold in reward_model
        content, gold = row["prompt"][0]["content"], str(row["reward_model"]["ground_truth"])
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"{where}: missing field 'prompt[0].content' or 'reward_model.ground_truth'") from None
    if content.startswith(DAPO_PREFIX) and content.endswith(DAPO_SUFFIX):
        content = content[len(DAPO_PREFIX):len(content) - len(DAPO_SUFFIX)]
    return content, gold


def load_problems(spec):
    """[(problem, answer)] from a local .jsonl/.parquet or a Hub dataset, duplicates of a problem dropped."""
    if spec.endswith(".jsonl"):
        rows = read_jsonl(spec)
    else:
        import datasets
        ds = datasets.load_dataset("parquet", data_files=spec)["train"] if spec.endswith(".parquet") else \
            datasets.load_dataset(spec, split="train")
        rows = [(f"{spec}: row {i}", r) for i, r in enumerate(ds)]
    seen, out = set(), []
    for where, row in rows:
        problem, answer = _problem_answer(row, where)
        if problem not in seen:
            seen.add(problem)
            out.append((problem, answer))
    return out


def encode_prompt(tok, problem, chat_template=True, enable_thinking=False):
    text = problem + SUFFIX
    if chat_template and tok.chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True, enable_thinking=enable_thinking)
    return tok(text, add_special_tokens=False)["input_ids"]


def step_prompts(data, step, args, rank, world):
    """This rank's share of step `step`'s prompts, mini-batch by mini-batch: mini-batch b is the same
    block of prompts whatever the world size. The data is shuffled anew (seeded) every epoch."""
    per_mb, n = args.prompts_per_step // args.minibatches, len(data)
    orders = {e: torch.randperm(n, generator=torch.Generator().manual_seed(args.seed * 7919 + e)) for e in
              {g // n for g in range(step * args.prompts_per_step, (step + 1) * args.prompts_per_step)}}
    out = []
    for b in range(args.minibatches):
        first = step * args.prompts_per_step + b * per_mb + rank * (per_mb // world)
        out += [(g, *data[int(orders[g // n][g % n])]) for g in range(first, first + per_mb // world)]
    return out


# ---- the model ----------------------------------------------------------------------------------------

class Policy(torch.nn.Module):
    """A causal LM whose forward gives (log p, H) of the response tokens, never the full logits."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, attention_mask, response, temperature):
        h = self.lm.get_decoder()(input_ids=ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        at = response[:, 1:]  # the hidden state at t predicts token t + 1
        return token_logprobs_and_entropy(h[:, :-1][at], self.lm.get_output_embeddings().weight,
                                          ids[:, 1:][at], temperature)


def build_policy(path, mesh, device):
    """fp32 master weights sharded by FSDP2 per decoder layer, then the root; bf16 compute on GPU."""
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    mp = MixedPrecisionPolicy()
    if device.type == "cuda":
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = Policy(lm)
    for layer in lm.get_decoder().layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    return fully_shard(policy, mesh=mesh, mp_policy=mp).train()


def full_params(policy):
    """(HF name, full tensor) one parameter at a time, in the same order on every rank (a collective)."""
    for name, p in policy.lm.named_parameters():
        yield name, p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def micro_batches(rows, idx, budget):
    """Split sample indices into micro-batches of at most `budget` padded tokens, the same count on
    every rank (FSDP's collectives need it): a rank with fewer runs empty ones (None)."""
    out, cur, longest = [], [], 0
    for i in idx:
        n = len(rows[i][0]) + len(rows[i][1])
        if cur and max(longest, n) * (len(cur) + 1) > budget:
            out.append(cur)
            cur, longest = [], 0
        cur, longest = cur + [i], max(longest, n)
    out += [cur] if cur else []
    n = torch.tensor([len(out)])
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return out + [None] * (int(n) - len(out))


def forward(policy, rows, idx, valid, temperature, device):
    """(log p, H) [len(idx), R] of the response tokens of samples idx (zero outside `valid`)."""
    seqs = [rows[i][0] + rows[i][1] for i in idx]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    response = torch.zeros_like(ids, dtype=torch.bool)
    for k, (i, s) in enumerate(zip(idx, seqs)):
        ids[k, :len(s)] = torch.tensor(s)
        response[k, len(rows[i][0]):len(s)] = True
    attn = (torch.arange(ids.shape[1]) < torch.tensor([len(s) for s in seqs])[:, None]).long()
    logp, ent = policy(ids.to(device), attn.to(device), response.to(device), temperature)
    v = valid[idx]
    return torch.zeros(v.shape, device=device).masked_scatter(v, logp), \
        torch.zeros(v.shape, device=device).masked_scatter(v, ent)


@torch.no_grad()
def no_grad_pass(policy, rows, idx, valid, args, device):
    logp, ent = torch.zeros(valid.shape, device=device), torch.zeros(valid.shape, device=device)
    for mb in micro_batches(rows, idx, args.micro_tokens):
        out = forward(policy, rows, mb or idx[:1], valid, args.temperature, device)
        if mb:
            logp[mb], ent[mb] = out
    return logp[idx], ent[idx]


def token_weights(method, logp, ent, adv, valid, args):
    """Per-token weights `keep` and their global denominator for each objective the paper compares."""
    keep, stats = valid, {}  # justrl: every response token
    if method == "grpo":  # token mean per sequence, then mean over sequences
        return valid / valid.sum(1, keepdim=True).clamp(min=1), all_sum(len(valid))[0], stats
    if method == "entropy20":  # the top 20% entropy tokens of the mini-batch (all ranks)
        keep = valid & (ent >= torch.quantile(gather_cat(ent[valid]), 0.8).to(ent.device))
    elif method == "stapo":  # S2T, with one tau_h over the mini-batch's candidates on all ranks
        cand = s2t_mask(logp, ent, adv, valid, args.tau_p, tau_h=float("inf"))  # every candidate has H < inf
        pooled = gather_cat(ent[cand])
        tau_h = torch.quantile(pooled, args.q).item() if len(pooled) else None
        silenced = s2t_mask(logp, ent, adv, valid, args.tau_p, args.q, tau_h)  # none pooled: none here either
        keep = valid & ~silenced
        stats = {"silenced": silenced, "candidates": len(pooled), "tau_h": tau_h}
    return keep, all_sum(keep.sum())[0], stats


def train_step(step, policy, opt, engine, tok, prompts, args, device):
    """One step of the paper's loop on this rank's prompts. Returns (metrics, silenced-token records)."""
    from reward import score_all
    t0, G = time.time(), args.group_size
    # 1-3. rollout, reward, group advantages
    groups = engine.generate([p for _, p, _ in prompts], G, args.temperature, args.top_p, args.max_response_len,
                             seeds=[args.seed * 1_000_003 + step * 100_003 + g for g, _, _ in prompts])
    engine.sleep()
    samples = [s for grp in groups for s in grp]
    rows = [(p, s.tokens) for (_, p, _), grp in zip(prompts, groups) for s in grp]
    rewards = torch.tensor(score_all(tok.batch_decode([s.tokens for s in samples], skip_special_tokens=True),
                                     [a for _, _, a in prompts for _ in range(G)]))
    adv = group_advantages(rewards, G).to(device)
    rlen = torch.tensor([len(s.tokens) for s in samples])
    valid = (torch.arange(max(1, int(rlen.max()))) < rlen[:, None]).to(device)
    t_rollout = time.time() - t0
    # 4. the old policy: log p of every sampled token, and p and H for the first mini-batch's S2T
    everyone = list(range(len(rows)))
    old_logp, old_ent = no_grad_pass(policy, rows, everyone, valid, args, device)
    gap = torch.zeros(0, device=device)  # |sampler log p - trainer log p|: it jumps when a sync breaks
    if samples[0].logprobs is not None:
        gap = (torch.tensor([x for s in samples for x in s.logprobs], device=device) - old_logp[valid]).abs()
    acc = {"samples": len(samples), "correct": (rewards > 0).sum(), "tokens": sum(len(p) + len(r) for p, r in rows),
           "flat_groups": (rewards.view(-1, G).std(1) == 0).sum(), "valid": valid.sum(), "length": rlen.sum(),
           "entropy": old_ent[valid].sum(), "truncated": sum(s.finish_reason == "length" for s in samples),
           "gap_n": gap.numel(), "gap": gap.sum(), "silenced": 0, "candidates": 0, "kept": 0, "clip_low": 0,
           "clip_high": 0}
    # 5. mini-batch updates
    lr = args.lr * min(1.0, (step + 1) / max(1, args.warmup_steps))
    for group in opt.param_groups:
        group["lr"] = lr
    eps_high, clip_c = (args.eps_low, None) if args.method == "grpo" else (args.eps_high, args.clip_c)
    per, tau_hs, grad_norms, silenced_log = len(rows) // args.minibatches, [], [], []
    for b in range(args.minibatches):
        idx = everyone[b * per:(b + 1) * per]
        logp, ent = (old_logp[idx], old_ent[idx]) if b == 0 else no_grad_pass(policy, rows, idx, valid, args, device)
        keep, denom, st = token_weights(args.method, logp, ent, adv[idx], valid[idx], args)
        if st:
            acc["silenced"] += st["silenced"].sum()
            acc["candidates"] += st["candidates"]
            tau_hs += [st["tau_h"]] if st["tau_h"] is not None else []
            silenced_log += [{"step": step + 1, "token": tok.decode(r[t:t + 1]), "p": logp[i, t].exp().item(),
                              "H": ent[i, t].item(), "left": tok.decode(r[:t])[-40:], "right": tok.decode(r[t + 1:])[:40]}
                             for i, t in st["silenced"].nonzero().tolist() for r in [rows[idx[i]][1]]
                             ] if args.log_silenced else []
        keep_all = torch.zeros(valid.shape, dtype=keep.dtype, device=device)
        keep_all[idx] = keep
        mbs = micro_batches(rows, idx, args.micro_tokens)
        for k, mb in enumerate(mbs):
            sel = mb or idx[:1]  # an empty micro-batch runs one sample at zero weight
            policy.set_requires_gradient_sync(k == len(mbs) - 1)
            logp_mb, _ = forward(policy, rows, sel, valid, args.temperature, device)
            loss, st = stapo_loss(logp_mb, old_logp[sel], adv[sel], keep_all[sel] * bool(mb), denom, args.eps_low,
                                  eps_high, clip_c)
            (loss * dist.get_world_size()).backward()  # FSDP averages over ranks; the loss is already global
            acc["kept"] += st["kept"]
            acc["clip_low"] += st["clip_low"] * st["kept"]
            acc["clip_high"] += st["clip_high"] * st["kept"]
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip).full_tensor()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    t_train = time.time() - t0 - t_rollout
    # 6. sync the engine
    engine.load_weights(full_params(policy))
    n = dict(zip(acc, all_sum(*acc.values())))  # summed over ranks
    maxes = torch.tensor([float(rlen.max()), float(gap.max()) if gap.numel() else 0.0])
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    step_s = time.time() - t0
    return {"step": step + 1, "reward_mean": float(all_sum(rewards.sum())[0]) / n["samples"],
            "accuracy": n["correct"] / n["samples"], "zero_variance_groups": n["flat_groups"] * G / n["samples"],
            "response_len_mean": n["length"] / n["samples"], "response_len_max": int(maxes[0]),
            "truncated": n["truncated"] / n["samples"], "entropy_mean": n["entropy"] / max(n["valid"], 1),
            "silenced_frac": n["silenced"] / max(n["valid"], 1), "candidates": int(n["candidates"]),
            "tau_h": sum(tau_hs) / len(tau_hs) if tau_hs else None, "clip_low": n["clip_low"] / max(n["kept"], 1),
            "clip_high": n["clip_high"] / max(n["kept"], 1), "grad_norm": sum(grad_norms) / len(grad_norms), "lr": lr,
            "logprob_gap_mean": n["gap"] / n["gap_n"] if n["gap_n"] else None,
            "logprob_gap_max": float(maxes[1]) if n["gap_n"] else None, "rollout_s": t_rollout, "train_s": t_train,
            "step_s": step_s, "tokens_per_s": n["tokens"] / step_s}, silenced_log


# ---- checkpoints ----------------------------------------------------------------------------------------

def save_hf(policy, tok, path, rank):
    """An HF-format model (loadable by transformers and vLLM) and the tokenizer, written by rank 0."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    sd = get_model_state_dict(policy.lm, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        policy.lm.save_pretrained(path, state_dict=sd)
        tok.save_pretrained(path)


def save_checkpoint(step, policy, opt, tok, args, rank):
    """out/ckpt/step_N: hf/ (the model), dcp/ (sharded model + optimizer), rng<rank>.pt, state.json.
    Written under a temporary name and renamed when complete, so a crash never leaves a half checkpoint."""
    final = os.path.join(args.out, "ckpt", f"step_{step}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(policy, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(tmp, "dcp"))
    torch.save({"python": random.getstate(), "torch": torch.get_rng_state()}, os.path.join(tmp, f"rng{rank}.pt"))
    save_hf(policy, tok, os.path.join(tmp, "hf"), rank)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(tmp, "state.json"), "w") as f:
            json.dump({"step": step, "data_position": step * args.prompts_per_step}, f)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    dist.barrier()


def load_checkpoint(policy, opt, args, rank):
    """Restore the latest complete checkpoint; returns the number of steps it had done (0 if none)."""
    root = os.path.join(args.out, "ckpt")
    done = [int(d[5:]) for d in os.listdir(root) if d.startswith("step_") and d[5:].isdigit()] \
        if os.path.isdir(root) else []
    if not done:
        return 0
    path = os.path.join(root, f"step_{max(done)}")
    model_sd, optim_sd = get_state_dict(policy, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, "dcp"))
    set_state_dict(policy, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    rng = torch.load(os.path.join(path, f"rng{rank}.pt"), weights_only=False)
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    return max(done)


# ---- main -----------------------------------------------------------------------------------------------

def train(args):
    from tqdm import tqdm
    from transformers import AutoTokenizer
    from rollout import make_engine
    rank, world, device, mesh = init_distributed()
    if args.prompts_per_step % (args.minibatches * world):
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} must split evenly into --minibatches "
                         f"{args.minibatches}, each over {world} ranks")
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    tok = AutoTokenizer.from_pretrained(args.model)
    data = [(ids, a) for ids, a in ((encode_prompt(tok, p, args.chat_template, args.enable_thinking), a)
                                    for p, a in load_problems(args.dataset)) if len(ids) <= args.max_prompt_len]
    policy = build_policy(args.model, mesh, device)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    start = load_checkpoint(policy, opt, args, rank) if args.resume else 0
    engine = make_engine(args.engine, args.model, tok, device, rank, args.max_prompt_len + args.max_response_len,
                         args.gpu_memory_utilization)
    engine.load_weights(full_params(policy))  # vLLM starts from dummy weights; after --resume, the loaded ones
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "config.json"), "w") as f:
            json.dump({**vars(args), "world_size": world, "device": str(device), "problems": len(data)}, f, indent=1)
    for step in tqdm(range(start, args.steps), disable=rank != 0, desc="stapo", initial=start, total=args.steps):
        metrics, silenced = train_step(step, policy, opt, engine, tok, step_prompts(data, step, args, rank, world),
                                       args, device)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            from eval import evaluate_during_training
            metrics.update(evaluate_during_training(engine, tok, args, rank, world))
        silenced = sum(gather(silenced), [])
        if rank == 0:
            with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(metrics) + "\n")
            if silenced:
                with open(os.path.join(args.out, "silenced.jsonl"), "a") as f:
                    f.writelines(json.dumps(x) + "\n" for x in silenced)
            tqdm.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
                                if k in ("step", "reward_mean", "accuracy", "silenced_frac", "response_len_mean",
                                         "entropy_mean", "grad_norm", "step_s")))
        if args.save_every and (step + 1) % args.save_every == 0:
            save_checkpoint(step + 1, policy, opt, tok, args, rank)
    save_hf(policy, tok, os.path.join(args.out, "model"), rank)
    dist.barrier()
    return policy


if __name__ == "__main__":
    train(get_args())
    dist.destroy_process_group()
