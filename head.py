"""head.py: the LM head's log-probs and entropies of the sampled tokens, a chunk of tokens at a time, so the
[tokens, vocabulary] logits never exist. Torch only: copy it with the loss.

One per-chunk forward (chunk_stats) and one per-slice backward (slice_grad), the same on every device. Where
the head compiles (CUDA by default; STAPO_HEAD_COMPILE=1 anywhere, 0 nowhere) torch.compile fuses each into a
pass or two over the logits; elsewhere they run eager. A compile that fails warns once, and that function runs
eager from then on.
"""
import os
import warnings

import torch

COMPILE = os.environ.get("STAPO_HEAD_COMPILE", "auto")
CPU_CHUNK = 128  # rows per chunk on a CPU (chunk_rows)


def compiles(device):
    """Whether the head compiles its per-chunk math on `device`: on CUDA (auto), everywhere (1), nowhere (0)."""
    return COMPILE == "1" or (COMPILE == "auto" and torch.device(device).type == "cuda")


def chunk_rows(device, vocab):
    """The forward's tokens per chunk for chunk_size=None, by device and vocabulary. GPU: the largest power of
    two up to 1,024 whose [rows, V] fp32 logits hold at most 2^28 values (1 GiB), so each chunk is one large
    matmul (1,024 at Qwen3's V = 151,936). CPU: CPU_CHUNK, whose [rows, V] fp32 buffers stay small beside
    the lm_head gradient; docs/performance.md has the measurements behind both."""
    if torch.device(device).type == "cpu":
        return CPU_CHUNK
    rows = 1024
    while rows > 128 and rows * vocab > 2 ** 28:
        rows //= 2
    return rows


def logits(h, w, temperature, out=None):
    """z = h @ w.T / T in fp32, rounded to w's dtype first, as the model's own head rounds them; written into
    `out` (an fp32 [n, V'] buffer) when one is given, else a fresh tensor."""
    if out is None:
        return (h.to(w.dtype) @ w.T).float().div_(temperature)
    if w.dtype == torch.float32:
        return torch.mm(h.to(w.dtype), w.T, out=out).div_(temperature)
    return out.copy_(h.to(w.dtype) @ w.T).div_(temperature)  # the rounded logits, widened in the buffer


def chunk_stats(h, w, tokens, temperature, collision: bool, space=None):
    """The forward of a chunk of hidden states h [n, D] under the head w [V, D]: log Z, log p(token), H and
    sum pi^2 (None unless collision), each [n] in fp32. It works in place on its logits z, in `space` (two fp32
    [n, V] buffers) when given, else in fresh ones."""
    z_out, e_out = (None, None) if space is None else space
    z = logits(h, w, temperature, z_out)
    zmax = z.amax(-1, keepdim=True)
    z.sub_(zmax)  # z <= 0, the mode at 0: no cancellation in H for peaked distributions
    e = torch.exp(z, out=e_out)  # pi * total
    total = e.sum(-1)
    log_total = total.log()
    logp = z.gather(-1, tokens[:, None])[:, 0] - log_total
    sum_sq = (e * e).sum(-1) / total ** 2 if collision else None
    entropy = log_total - e.mul_(z).sum(-1) / total  # -sum pi log pi; e is e * z from here
    return zmax[:, 0] + log_total, logp, entropy, sum_sq


def slice_grad(h, w, logz, scale, column, temperature, space=None):
    """The backward at a slice of the vocabulary w [V', D]: d log p_y / d z = (onehot(y) - softmax(z)) / T times
    the incoming gradient (scale = grad / T), for z = h @ w.T and column = y - the slice's first id; returned in
    w's dtype, worked on in `space` (an fp32 [M, V'] buffer) when given. The sampled entry, scale * (1 - p_y),
    is computed in fp32 from its row's log p_y and written after the cast, one entry per row: added in bf16
    after the cast, bf16(-p_y * scale) + scale would cancel to 0 for p_y > 1 - 2^-9 (a confident token). No
    [M, V'] pass of its own; compiled, no fp32 [M, V'] tensor either (the gather reads the matmul's output)."""
    z = logits(h, w, temperature, space).sub_(logz[:, None])  # log softmax(z)
    col = column.clamp(0, len(w) - 1)[:, None]
    here = torch.where((column >= 0) & (column < len(w)), scale, 0.0)[:, None]  # y in this slice, on its row
    own = z.gather(1, col).exp_().mul_(-scale[:, None]).add_(here)  # (onehot - softmax) * scale at y, in fp32
    return z.exp_().mul_(-scale[:, None]).to(w.dtype).scatter_(1, col, own.to(w.dtype))


_compiled = {}  # chunk_stats or slice_grad -> its torch.compile, or None once that compile failed


def per_chunk(fn, device, *args):
    """fn(*args): compiled where the head compiles (compiles), else eager; a compile that fails warns once and
    leaves fn eager from then on."""
    if compiles(device) and fn not in _compiled:
        _compiled[fn] = torch.compile(fn)
    if not compiles(device) or _compiled[fn] is None:
        return fn(*args)
    try:
        return _compiled[fn](*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # no compiler, an unsupported backend: eager from now on
        warnings.warn(f"head.py: torch.compile of {fn.__name__} failed, eager from now on ({type(e).__name__}: "
                      f"{str(e)[:200]})")
        _compiled[fn] = None
        return fn(*args)


def scratch(hidden, shape):
    """Eager, the head reuses one fp32 buffer of `shape` for every chunk: a fresh [chunk, V] tensor each chunk
    costs a CPU its page faults (glibc maps every allocation this large anew). Compiled, None: inductor plans
    its own memory, and a buffer handed in would only add a write."""
    return None if compiles(hidden.device) else hidden.new_empty(shape, dtype=torch.float32)


class ChunkedHead(torch.autograd.Function):
    """log p(token), with H of each position and, when asked (collision=True), sum(pi^2), from hidden states.

    The forward takes `chunk_size` tokens at a time (None: chunk_rows's choice for the device): [chunk, V]
    fp32 logits and their exp (then their product), in place.
    The backward recomputes the logits a slice of the vocabulary at a time, [M, V'] with M * V' no more than
    chunk * V, and applies d log p_y / d z = (onehot(y) - softmax(z)) / T: each slice of the lm_head gradient
    is written once, only the small [M, D] hidden gradient is accumulated (in fp32), and [M, V] never exists.
    """

    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, chunk_size, collision=False):
        chunk_size = chunk_size or chunk_rows(hidden.device, len(weight))
        logp, logz, entropy = (hidden.new_empty(len(hidden), dtype=torch.float32) for _ in range(3))
        sum_sq = hidden.new_empty(len(hidden) if collision else 0, dtype=torch.float32)  # sum pi^2, if asked
        space = scratch(hidden, (2, min(chunk_size, len(hidden)), len(weight)))
        for i in range(0, len(hidden), chunk_size):
            j = slice(i, i + chunk_size)
            here = None if space is None else space[:, :len(hidden[j])]
            logz[j], logp[j], entropy[j], sq = per_chunk(chunk_stats, hidden.device, hidden[j], weight, tokens[j],
                                                         temperature, collision, here)
            if collision:
                sum_sq[j] = sq
        ctx.save_for_backward(hidden, weight, tokens, logz)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(entropy, sum_sq)
        return logp, entropy, sum_sq

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy, _grad_sum_sq):
        hidden, weight, tokens, logz = ctx.saved_tensors
        h = hidden.to(weight.dtype)
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_w = torch.empty_like(weight)
        width = max(1, ctx.chunk_size * len(weight) // max(1, len(hidden)))
        scale = grad_logp / ctx.temperature
        space = scratch(hidden, (len(hidden) * width,))
        for v in range(0, len(weight), width):
            w = weight[v:v + width]
            here = None if space is None else space[:len(h) * len(w)].view(len(h), len(w))
            g = per_chunk(slice_grad, hidden.device, h, w, logz, scale, tokens - v, ctx.temperature, here)
            torch.mm(g.T, h, out=grad_w[v:v + width])  # this slice of the lm_head gradient, once
            grad_h += g @ w  # in fp32: the sum over the slices
        return grad_h.to(hidden.dtype), grad_w, None, None, None, None


def token_logprobs_and_entropy(hidden, weight, tokens, temperature=1.0, chunk_size=None):
    """Log-prob (with grad) and entropy (no grad, nats) of each sampled token, from hidden states.

    hidden: [M, D] the final hidden state before each token; weight: [V, D] the lm_head weight;
    tokens: [M] the sampled ids. Logits are divided by the sampling temperature, as the sampler did.
    Works in chunks, so the [M, V] logits (let alone their fp32 log-softmax) never exist; equal to
    log_softmax(hidden @ weight.T / T) gathered at tokens, in values and gradients. chunk_size=None: the
    head's choice for the device and vocabulary (chunk_rows).
    """
    logp, entropy, _ = ChunkedHead.apply(hidden, weight, tokens, float(temperature), chunk_size)
    return logp, entropy
