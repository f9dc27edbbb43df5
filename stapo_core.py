"""stapo_core.py: the STAPO paper (arXiv 2602.15620) as pure functions. It imports only torch: copy this file
into your own trainer (TRL, verl, your own). stapo.py runs it with FSDP2; head.py computes the log-probs and
entropies it needs without the full logits.

The paper's recipe is JustRL's (GRPO group advantages, clip-higher, dual clip, token-mean loss, no KL, no
entropy bonus) plus the S2T mask, which silences the rare "spurious" tokens: tokens of correct answers (A > 0)
that the policy gave a low probability (p < tau_p) at a low-entropy position (H < tau_h).
"""
import torch


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


def s2t_candidates(logp, adv, valid, tau_p=0.002):
    """S2T's candidates: valid & (A > 0) & (p < tau_p), a bool [N, T] (or [M] for packed tokens, adv [M]).
    adv: [N], [N, 1] or [N, T]; other shapes are a ValueError, as in stapo_loss. A fresh or tiny model makes
    many: p ~ 1/V is already below tau_p for any V > 500."""
    check_shapes("s2t_candidates", logp, adv, valid)
    adv = adv if adv.dim() == logp.dim() else adv[:, None]
    return valid.bool() & (adv > 0) & (logp.exp() < tau_p)


def s2t_threshold(candidate_entropies, q=0.75):
    """tau_h, the q-quantile of the candidates' entropies (pass every rank's, gathered, for one
    threshold over a data-parallel mini-batch); None when there are no candidates anywhere."""
    if candidate_entropies.numel() == 0:
        return None
    return quantile(candidate_entropies, q)


def s2t_silence(candidates, entropy, tau_h):
    """The S2T mask from the candidates and tau_h: candidates & (H < tau_h), a bool [N, T], True = silenced;
    tau_h None (no candidate on any rank): nothing silenced."""
    return candidates if tau_h is None else candidates & (entropy < tau_h)


def s2t_mask(logp, entropy, adv, valid, tau_p=0.002, q=0.75, tau_h=None):
    """The S2T mask (paper: Silencing Spurious Tokens, M_{i,t}). A bool [N, T], True = silenced.

    logp, entropy: [N, T] log-prob of each sampled token and the full-vocabulary entropy (nats) of
    the policy at that position, both detached. adv: [N], [N, 1] or [N, T]. valid: [N, T] mask.
        candidates C = valid & (A > 0) & (p < tau_p)            s2t_candidates
        tau_h = q-quantile of H over C      (linear interpolation, in H's precision; s2t_threshold)
        silenced = C & (H < tau_h)          (no candidate: nothing silenced; s2t_silence)
    A given tau_h overrides the quantile. Data-parallel, one threshold over every rank's tokens, in the
    three steps this function takes:
        candidates = s2t_candidates(logp, adv, valid, tau_p)
        tau_h = s2t_threshold(all_gather_cat(entropy[candidates]), q)   # your framework's gather
        silenced = s2t_silence(candidates, entropy, tau_h)
    """
    candidates = s2t_candidates(logp, adv, valid, tau_p)
    if tau_h is None:
        tau_h = s2t_threshold(entropy[candidates], q)
    return s2t_silence(candidates, entropy, tau_h)


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
    stats = {clip_low, clip_high: the kept tokens' clipped fractions; kept: their count}, 0-dim tensors
    keep = valid & ~silenced (bool or 0/1), so the loss is renormalised over the tokens neither
    padded nor silenced; a float keep is a weight (GRPO's 1/|o_i|, whose sum is the number of
    sequences). Silenced and padded tokens get exactly zero gradient.
    num_tokens: None, a Python number or a 0-dim tensor (an all-reduced count). A count of 0 gives a zero
    loss with a zero gradient; a negative Python number is a ValueError, while a tensor is never read (a
    tensor <= 0 gives the zero loss).
    Nothing in the call waits on the device (no .item(), no float() or bool() of a tensor), for each of the
    three kinds of num_tokens: it compiles whole under torch.compile(fullgraph=True), and a trainer reads the
    stats once per optimizer step, not per micro-batch.
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
    check_shapes("stapo_loss", logp, adv, old_logp, keep)
    if isinstance(num_tokens, torch.Tensor) and num_tokens.dim() != 0:  # a [1] count would make a [1] loss
        raise ValueError(f"stapo_loss: num_tokens must be a 0-dim tensor, got shape {tuple(num_tokens.shape)}")
    adv = adv.detach().float()
    adv = (adv if adv.dim() == logp.dim() else adv[:, None]).expand_as(logp)
    kept = keep > 0
    log_ratio = (logp.float() - old_logp.detach().float()).clamp(-max_log_ratio, max_log_ratio)
    ratio = torch.where(kept, log_ratio, 0.0).exp()  # masked before exp: a padded token's garbage never overflows
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    per_token = torch.maximum(-ratio * adv, -clipped * adv)
    if clip_c is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -clip_c * adv), per_token)
    per_token = torch.where(kept, per_token, 0.0) * keep  # and after: 0 * inf would be NaN, a where is 0
    if num_tokens is None or isinstance(num_tokens, torch.Tensor):  # divided on the device, never read
        n, total = (keep.sum() if num_tokens is None else num_tokens).float(), per_token.sum()
        loss = torch.where(n > 0, total / n.clamp(min=torch.finfo(torch.float32).tiny), total * 0.0)
    elif num_tokens < 0:
        raise ValueError(f"stapo_loss: num_tokens must be >= 0, got {num_tokens}")
    else:
        loss = per_token.sum() / num_tokens if num_tokens > 0 else per_token.sum() * 0.0
    with torch.no_grad():  # tensors, never read here: a trainer reads them once per optimizer step
        k = kept.sum().clamp(min=1).double()  # fractions in float64: exact counts past float32's 2^24 tokens
        stats = {"clip_low": (kept & (adv < 0) & (ratio < 1 - eps_low)).sum() / k,
                 "clip_high": (kept & (adv > 0) & (ratio > 1 + eps_high)).sum() / k,
                 "kept": kept.sum()}
    return loss, stats


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

def check_shapes(where, logp, adv, *same):
    """logp and each of `same` share one shape, [N, T] or packed [M]; adv is [N], [N, 1] or [N, T] for [N, T],
    [M] for packed tokens: else a ValueError naming the shapes (a wrong shape would broadcast silently)."""
    if logp.dim() not in (1, 2) or any(x.shape != logp.shape for x in same):
        raise ValueError(f"{where}: logp, old_logp, keep/valid must share one shape [N, T] or [M]; got "
                         f"{', '.join(str(tuple(x.shape)) for x in (logp, *same))}")
    per_row = logp.dim() == 2 and adv.shape in (logp.shape[:1], (logp.shape[0], 1))
    if adv.shape != logp.shape and not per_row:
        raise ValueError(f"{where}: adv must be [N], [N, 1] or [N, T] (padded logp), [M] (packed logp); got "
                         f"adv {tuple(adv.shape)} for logp {tuple(logp.shape)}")

