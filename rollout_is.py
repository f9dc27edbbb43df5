"""rollout_is.py: weights against the sampler-trainer mismatch (stapo.py --rollout-is), not the paper's. In
bf16 the sampler's kernels give other log-probs than the trainer's for the same weights; truncated importance
sampling (TIS) weighs each token of the loss by how far the policy that is trained is from the one that
sampled.
"""
import math


def rollout_is_weights(old_logp, sampler_logp, valid, level="token", cap=2.0, mode="truncate"):
    """Per-token factors on the loss's `keep`:
        rho = pi_old(y) / pi_sampler(y)     per token, or per response (level="sequence": the product)
        w = min(rho, cap)                   (mode="truncate", TIS)
        w = rho if rho <= cap else 0        (mode="mask")
    Returns (w [N, T], zero at padding; rho [N, T] or [N, 1] in float64, for the logs)."""
    log_rho = (old_logp - sampler_logp).masked_fill(~valid.bool(), 0.0)
    if level == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True)
    w = log_rho.clamp(max=math.log(cap)).exp()
    if mode == "mask":
        w = w.masked_fill(log_rho > math.log(cap), 0.0)
    return w.expand_as(old_logp) * valid, log_rho.double().exp()
