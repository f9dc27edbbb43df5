"""analysis.py: the paper's token-level view of training (stapo.py --analysis), not part of its algorithm: it
measures each mini-batch and changes nothing. Per token: the norm of the gradient the loss applies to its
logits (and the one it would apply were S2T's set kept), the policy-gradient norm and the entropy change of
the paper's identity and lemma; per step, each set's share of the gradient and the eight groups' means.
"""
import math

import torch

# The taxonomy's eight groups: the sign of A, p below or above tau_p, H below or above S2T's tau_h. The four
# posA groups are the late paper's (posA_lowP_lowH is the set S2T silences); with the four negA groups they
# are the early version's eight.
GROUPS = [f"{a}A_{p}P_{h}H" for a in ("pos", "neg") for p in ("low", "high") for h in ("low", "high")]
SPURIOUS = "posA_lowP_lowH"
SHARES = ("silenced", "candidates_kept", "rest")


def loss_token_coef(logp, old_logp, adv, keep, num_tokens=None, eps_low=0.2, eps_high=0.28, clip_c=10.0,
                      max_log_ratio=20.0):
    """d stapo_loss / d logp of each token (paper: the token's term of grad J_STAPO), for the same arguments:
    the loss's gradient on the token's logits is this coefficient times (e_y - pi) / T. No graph.
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


def logit_gradient_norm(logp, collision, coef, temperature=1.0):
    """||d (w log pi_y) / d a|| of each token, a its logits, pi = softmax(a / T) (the paper's identity, with
    w = A): ||grad||^2 = w^2 (1 - 2 pi_y + sum_n pi_n^2) / T^2, sum pi^2 >= exp(-H). With w the loss's own
    coefficient (loss_token_coef) it is the norm of the gradient the loss applies there."""
    return coef.abs() / temperature * (1 - 2 * logp.exp() + collision).clamp(min=0).sqrt()


def entropy_change(logp, entropy, coef):
    """The paper's lemma: the first-order change of H at a token's position under a natural-gradient step,
    logit_y += eta * w (w = A in the paper), per unit eta: dH = -w pi_y (log pi_y + H). (A plain gradient
    step on the logits, a += eta * w (e_y - pi), changes H by -eta w (pi_y (log pi_y + H) - sum_n pi_n^2
    (log pi_n + H)) instead; BAPO's form carries a factor 1 - pi_y.)"""
    return -coef * logp.exp() * (logp + entropy)


def token_groups(low_p, adv, entropy, valid, tau_h):
    """{group: bool mask [N, T]} of the valid tokens with A != 0, H split at tau_h (S2T's threshold of the
    mini-batch); with low_p = p < tau_p, the SPURIOUS group is exactly s2t_mask's silenced set."""
    low_h = entropy < tau_h
    masks = [s & p & h for s in (adv > 0, adv < 0) for p in (low_p, ~low_p) for h in (low_h, ~low_h)]
    return {g: m & valid for g, m in zip(GROUPS, masks)}


# The sums a step adds up over its mini-batches and ranks (metrics.StepMetrics), from which row() computes
KEYS = [*[f"g2/{k}" for k in SHARES], "g2/silenced_if_kept", "nonzero", "split",
        *[f"{g}/{k}" for g in GROUPS for k in ("n", "norm", "dH", "H")]]


class TokenAnalysis:
    """The token-level view of a mini-batch, as sums over this rank's tokens (KEYS; metrics.StepMetrics adds
    them up over the step's mini-batches and ranks, and asks row() for the metrics):
      - each set's sum of ||grad_a||^2 under the gradient the loss applies (S2T's silenced set, its other
        candidates, the rest), and the silenced set's sum under the gradient it would get if kept;
      - the eight groups' token counts, sums of the policy-gradient norm, of the entropy change and of H, in the
        mini-batches where S2T has a tau_h. With no candidate on any rank there is no tau_h to split H at:
        the mini-batch is left out of the groups, and `taxonomy/split` says how much was split.
    method, clip (eps_low, eps_high, clip_c), tau_p, temperature: the run's, as the loss uses them."""

    def __init__(self, method, clip, tau_p, temperature):
        self.method, self.clip, self.tau_p, self.temperature = method, clip, tau_p, temperature

    def sums(self, now, old_logp, adv, valid, scale, num_tokens, s2t, correction):
        """One mini-batch's sums from its [n, T] tensors: now, the current policy's log p, H and sum pi^2 (a
        policy.TokenStats); the old log p; the advantages adv [n]; the valid mask; each token's scale in the loss
        (stapo_loss's keep, its rollout-IS correction in it) and num_tokens; S2T's result (stapo.SpuriousTokens:
        its silenced set, its candidates and tau_h, None where no rank has a candidate); --rollout-is's
        correction (1 when off). The norm of the gradient the loss applies to each token's logits, and of the
        one it would apply with S2T's set kept (under stapo, every valid token back at its scale); each token's
        policy-gradient norm and entropy change (the paper's identity and lemma, with w = ratio * A, before the
        clips and S2T)."""
        logp, adv = now.logp, adv[:, None].expand_as(now.logp)
        unsilenced = scale if self.method != "stapo" else valid * correction
        norm = lambda coef: logit_gradient_norm(logp, now.collision, coef, self.temperature)  # noqa: E731
        applied, if_kept = (loss_token_coef(logp, old_logp, adv, k, num_tokens, *self.clip)
                            for k in (scale, unsilenced))
        coef = (logp - old_logp).exp() * adv  # ratio * A
        tokens = (norm(applied), norm(if_kept), norm(coef), entropy_change(logp, now.entropy, coef))
        return self.split(s2t.silenced, s2t.candidates, s2t.tau_h, now.entropy, logp.exp() < self.tau_p, adv,
                          valid, tokens)

    def split(self, silenced, candidates, tau_h, entropy, low_p, adv, valid, tokens):
        """The sums by set and group: S2T's silenced set, its candidates, tau_h and the entropies it split;
        low_p = p < tau_p; tokens: [N, T] norms of the applied gradient, of the gradient were S2T's set kept,
        of the policy-gradient term (w = ratio * A), and the entropy change."""
        applied, if_kept, norm, change = tokens
        parts = [silenced, candidates & ~silenced, valid & ~candidates]
        sums = {f"g2/{k}": applied[m].square().sum() for k, m in zip(SHARES, parts)}
        sums["g2/silenced_if_kept"] = if_kept[silenced].square().sum()
        sums["nonzero"] = (valid & (adv != 0)).sum()
        if tau_h is not None:
            sums["split"] = sums["nonzero"]
            for g, m in token_groups(low_p, adv, entropy, valid, tau_h).items():
                sums.update({f"{g}/n": m.sum(), f"{g}/norm": norm[m].sum(), f"{g}/dH": change[m].sum(),
                             f"{g}/H": entropy[m].sum()})
        return sums

    @staticmethod
    def row(n):
        """The step's metrics from its sums over ranks: shares_row and taxonomy_row."""
        return {**shares_row(n), **taxonomy_row(n)}


def shares_row(n):
    """Each set's share of sum ||grad_a||^2 as the loss applies it; and the silenced set's share were it kept
    (the same loss, those tokens given back their weight)."""
    total = sum(n[f"g2/{k}"] for k in SHARES)
    row = {f"grad_share/{k}": n[f"g2/{k}"] / total if total else None for k in SHARES}
    if_kept = total - n["g2/silenced"] + n["g2/silenced_if_kept"]
    row["grad_share/silenced_if_kept"] = n["g2/silenced_if_kept"] / if_kept if if_kept else None
    return row


def taxonomy_row(n):
    """Each group's share of the split tokens, mean policy-gradient norm, mean entropy change and mean H."""
    row, tokens = {"taxonomy/split": n["split"] / n["nonzero"] if n["nonzero"] else 0.0}, n["split"]
    for g in GROUPS:
        k = n[f"{g}/n"]
        row[f"taxonomy/{g}/tokens"] = k / tokens if tokens else 0.0
        row[f"taxonomy/{g}/grad_norm"] = n[f"{g}/norm"] / k if k else None
        row[f"taxonomy/{g}/dH"] = n[f"{g}/dH"] / k if k else None
        row[f"taxonomy/{g}/entropy"] = n[f"{g}/H"] / k if k else None
    return row


class Later:
    """What becomes of S2T's set, a few steps on (--analysis): an evenly spaced sample of each step's set on
    this rank (its context and token, and its log p then), and `after` steps later its log p at the same
    context under that step's policy. JustRL trains on these tokens with the whole sequence's A > 0, STAPO
    silences them: whether their probability then rose is the difference the mask makes to them."""

    def __init__(self, after=5, per_step=16):
        self.after, self.per_step, self.waiting = after, per_step, {}

    def keep(self, step, found):
        """found: the step's S2T set on this rank, (prompt ids, response ids, position t, log p) each; a sample
        of per_step of them waits, as (prompt ids, the response through its token, log p then)."""
        pick = [found[i * len(found) // self.per_step] for i in range(min(self.per_step, len(found)))]
        self.waiting[step] = [(prompt, response[:t + 1], logp) for prompt, response, t, logp in pick]

    def due(self, step):
        """The sample kept `after` steps before `step` (none before then): its rows and their log p then."""
        return self.waiting.pop(step - self.after, [])

    def row(self, n, then, now, rose):
        """The step's metrics from the sums over ranks of the due sample: its size, its mean log p then and
        now (at the same context), and the share of it whose p rose."""
        if not n:
            return {"s2t_later/tokens": 0, "s2t_later/logp_then": None, "s2t_later/logp_now": None,
                    "s2t_later/rose": None}
        return {"s2t_later/tokens": int(n), "s2t_later/logp_then": then / n, "s2t_later/logp_now": now / n,
                "s2t_later/rose": rose / n}
