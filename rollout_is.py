"""rollout_is.py: weights against the sampler-trainer mismatch (stapo.py --rollout-is), not the paper's. In
bf16 the sampler's kernels give other log-probs than the trainer's for the same weights; truncated importance
sampling (TIS) weighs each token of the loss by how far the policy that is trained is from the one that
sampled.
"""
import math

import torch


def rollout_is_weights(old_logp, sampler_logp, valid, level="token", cap=2.0, mode="truncate"):
    """Per-token factors on the loss's `keep`, for a step's whole batch (they depend on the old policy and the
    sampler alone):
        rho = pi_old(y) / pi_sampler(y)     per token, or per response (level="sequence": the product)
        w = min(rho, cap)                   (mode="truncate", TIS)
        w = rho if rho <= cap else 0        (mode="mask")
    level="none": w = 1 at every valid token (the paper's loss; sampler_logp is not read).
    Returns (w [N, T], zero at padding; rho in float64 for the logs: each valid token's, or each response's)."""
    if level == "none":
        return valid.float(), torch.zeros(0, dtype=torch.float64)
    log_rho = (old_logp - sampler_logp).masked_fill(~valid.bool(), 0.0)
    if level == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True)
    w = log_rho.clamp(max=math.log(cap)).exp()
    if mode == "mask":
        w = w.masked_fill(log_rho > math.log(cap), 0.0)
    rho = log_rho.double().exp()
    return w.expand_as(old_logp) * valid, rho[:, 0] if level == "sequence" else rho[valid.bool()]
