"""STAPO: Spurious-Token-Aware Policy Optimization (arXiv 2602.15620), the reference trainer.

Read top to bottom: first the algorithm as four pure functions that need only torch (copy them freely),
then the trainer that runs them with FSDP2 under torchrun:

    torchrun --nproc_per_node 8 stapo.py --model Qwen/Qwen3-8B

The paper's recipe is JustRL's (GRPO group advantages, clip-higher, dual clip, token-mean loss, no KL,
no entropy bonus) plus the S2T mask, which silences the rare "spurious" tokens: tokens of correct answers
(A > 0) that the policy gave a low probability (p < tau_p) at a low-entropy position (H < tau_h).
"""
import torch


# ----------------------------------------------------------------------------------------------------
# The algorithm: pure functions, torch only.
# ----------------------------------------------------------------------------------------------------

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
            g.scatter_add_(-1, tokens[j, None], grad_logp[j, None]).div_(ctx.temperature)
            g = g.to(weight.dtype)
            grad_h[j] = g @ weight
            grad_w.addmm_(g.T, hidden[j])
        return grad_h, grad_w, None, None, None


def token_logprobs_and_entropy(hidden, weight, tokens, temperature=1.0, chunk_size=256):
    """Log-prob (with grad) and entropy (no grad, nats) of each sampled token, from decoder hidden states.

    hidden: [M, D] the final hidden state before each token; weight: [V, D] the lm_head weight;
    tokens: [M] the sampled ids. Logits are divided by the sampling temperature, as the sampler did.
    Works in chunks of tokens, so the [M, V] logits (let alone their fp32 log-softmax) never exist;
    equal to log_softmax(hidden @ weight.T / T) gathered at tokens, in values and gradients.
    """
    return _ChunkedHead.apply(hidden, weight, tokens, float(temperature), chunk_size)
