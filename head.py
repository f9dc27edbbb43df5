"""head.py: the LM head's log-probs and entropies of the sampled tokens, a chunk of tokens at a time, so the
[tokens, vocabulary] logits never exist. Torch only: copy it with the loss.
"""
import torch


class ChunkedHead(torch.autograd.Function):
    """log p(token), with H of each position and, when asked (collision=True), sum(pi^2), from hidden states.

    The forward takes `chunk` tokens at a time, one [chunk, V] fp32 logits buffer (and its exp).
    The backward recomputes the logits a slice of the vocabulary at a time, [M, V'] with M * V' no
    more than chunk * V, and applies d log p_y / d z = (onehot(y) - softmax(z)) / T: each slice of
    the lm_head gradient is written once, only the small [M, D] hidden gradient is accumulated
    (in fp32), and [M, V] never exists.
    """

    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, chunk_size, collision=False):
        logp, logz, entropy = (hidden.new_empty(len(hidden), dtype=torch.float32) for _ in range(3))
        sum_sq = hidden.new_empty(len(hidden) if collision else 0, dtype=torch.float32)  # sum pi^2, if asked
        rows = min(chunk_size, len(hidden))  # three [chunk, V] buffers, reused by every chunk
        buffers = [hidden.new_empty(rows, len(weight), dtype=torch.float32) for _ in range(3)]
        for i in range(0, len(hidden), chunk_size):
            j = slice(i, i + chunk_size)
            z, e, product = (b[:len(hidden[j])] for b in buffers)
            h = hidden[j].to(weight.dtype)
            torch.mm(h, weight.T, out=z) if weight.dtype == z.dtype else z.copy_(h @ weight.T)
            top = z.div_(temperature).amax(-1, keepdim=True)
            z.sub_(top)  # z <= 0, the mode at 0: no cancellation in H for peaked distributions
            total = torch.exp(z, out=e).sum(-1)  # e = pi * total
            log_total = total.log()
            logz[j] = top[:, 0] + log_total
            logp[j] = z.gather(-1, tokens[j, None])[:, 0] - log_total
            entropy[j] = log_total - torch.mul(e, z, out=product).sum(-1) / total  # -sum pi log pi
            if collision:
                e.square_()  # pi^2 total^2
                sum_sq[j] = e.sum(-1) / total ** 2
        ctx.save_for_backward(hidden, weight, tokens, logz)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(entropy, sum_sq)
        return logp, entropy, sum_sq

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy, _grad_sum_sq):
        hidden, weight, tokens, logz = ctx.saved_tensors
        h, temperature = hidden.to(weight.dtype), ctx.temperature
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_w = torch.empty_like(weight)
        width = max(1, ctx.chunk_size * weight.shape[0] // max(1, len(hidden)))
        rows = torch.arange(len(hidden), device=hidden.device)
        scale = grad_logp / temperature
        buffer = hidden.new_empty(len(hidden) * width, dtype=torch.float32)  # one [M, V'] for every slice
        for v in range(0, weight.shape[0], width):
            w = weight[v:v + width]
            z = buffer[:len(hidden) * len(w)].view(len(hidden), len(w))
            torch.mm(h, w.T, out=z) if weight.dtype == z.dtype else z.copy_(h @ w.T)
            g = z.div_(temperature).sub_(logz[:, None]).exp_().mul_(-scale[:, None])  # -g softmax(z) / T
            here = (tokens >= v) & (tokens < v + width)
            g[rows[here], tokens[here] - v] += scale[here]  # + g * onehot(y) / T
            g = g.to(weight.dtype)
            torch.mm(g.T, h, out=grad_w[v:v + width])  # this slice of the lm_head gradient, once
            grad_h += g @ w  # in fp32: the sum over the slices
        return grad_h.to(hidden.dtype), grad_w, None, None, None, None


def token_logprobs_and_entropy(hidden, weight, tokens, temperature=1.0, chunk_size=128):
    """Log-prob (with grad) and entropy (no grad, nats) of each sampled token, from hidden states.

    hidden: [M, D] the final hidden state before each token; weight: [V, D] the lm_head weight;
    tokens: [M] the sampled ids. Logits are divided by the sampling temperature, as the sampler did.
    Works in chunks, so the [M, V] logits (let alone their fp32 log-softmax) never exist; equal to
    log_softmax(hidden @ weight.T / T) gathered at tokens, in values and gradients.
    """
    logp, entropy, _ = ChunkedHead.apply(hidden, weight, tokens, float(temperature), chunk_size)
    return logp, entropy
