"""head.py: the LM head's log-probs and entropies of the sampled tokens, a chunk of tokens at a time, so the
[tokens, vocabulary] logits never exist. Torch only: copy it with the loss.
"""
import os
import warnings

import torch

# The per-chunk math compiled by torch.compile: "auto" on CUDA only, "1" everywhere (the tests, on CPU),
# "0" never. STAPO_HEAD_COMPILE sets it; a compile that fails warns once, and the head runs eager after it.
COMPILE = os.environ.get("STAPO_HEAD_COMPILE", "auto")


def chunk_rows(device, vocab):
    """The forward's tokens per chunk for chunk_size=None, chosen by device and vocabulary.

    CPU: 128, a cache-sized chunk (its three [128, V] fp32 buffers are reused by every chunk).
    GPU: the largest power of two up to 1,024 whose [rows, V] fp32 buffer holds at most 2^28 values (1 GiB):
    1,024 at V = 151,936 (Qwen3), so each chunk is one large matmul. The head's working memory is then about
    14 x rows x V bytes (eager: three fp32 buffers and the matmul's output) or 4 x rows x V (compiled), plus
    the lm_head gradient, against the naive head's 12 x tokens x V: 0.073x of it at 16,384 tokens, eager
    (measured on an H200 at chunk 1,024, hidden 2,048).
    """
    if torch.device(device).type == "cpu":
        return 128
    rows = 1024
    while rows > 128 and rows * vocab > 2 ** 28:
        rows //= 2
    return rows


def chunk_stats(z, tokens, temperature, collision: bool):
    """The forward's per-chunk math from a chunk's logits z [n, V] (any dtype): log Z, log p(token), H and
    sum pi^2 (None unless collision), each [n] in fp32. Compiled: one pass or two over z, in its dtype."""
    z = z.float() / temperature
    top = z.amax(-1, keepdim=True)
    z = z - top
    e = z.exp()
    total = e.sum(-1)
    log_total = total.log()
    logp = z.gather(-1, tokens[:, None])[:, 0] - log_total
    entropy = log_total - (e * z).sum(-1) / total
    sum_sq = (e * e).sum(-1) / total ** 2 if collision else None
    return top[:, 0] + log_total, logp, entropy, sum_sq


def slice_grad(z, logz, scale, column, temperature, dtype: torch.dtype):
    """The backward's per-slice math: d log p_y / d z = (onehot(y) - softmax(z)) / T times the incoming
    gradient, for a vocabulary slice's logits z [M, V'], column = y - the slice's first id; in `dtype`."""
    g = (z.float() / temperature - logz[:, None]).exp() * -scale[:, None]
    hit = torch.arange(z.shape[1], device=z.device) == column[:, None]
    return (g + torch.where(hit, scale[:, None], 0.0)).to(dtype)


_compiled = {}  # name -> torch.compile'd function, or None once compiling it failed


def fused(name, *args):
    """chunk_stats or slice_grad, compiled on first use; eager, with a warning, if the compile fails."""
    eager = {"chunk_stats": chunk_stats, "slice_grad": slice_grad}[name]
    if name not in _compiled:
        _compiled[name] = torch.compile(eager)
    if _compiled[name] is not None:
        try:
            return _compiled[name](*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # no compiler, an unsupported backend: eager from now on
            warnings.warn(f"head.py: torch.compile of {name} failed, eager from now on ({type(e).__name__}: "
                          f"{str(e)[:200]})")
            _compiled[name] = None
    return eager(*args)


def compiled_here(device):
    """Whether the head runs its compiled per-chunk math on this device: after a failed compile, never (the
    call that failed finishes with the eager functions, the next runs the buffered passes)."""
    if None in _compiled.values():
        return False
    return COMPILE == "1" or (COMPILE == "auto" and torch.device(device).type == "cuda")


class ChunkedHead(torch.autograd.Function):
    """log p(token), with H of each position and, when asked (collision=True), sum(pi^2), from hidden states.

    The forward takes `chunk` tokens at a time (chunk_size=None: chunk_rows's choice for the device), one
    [chunk, V] fp32 logits buffer (and its exp).
    The backward recomputes the logits a slice of the vocabulary at a time, [M, V'] with M * V' no
    more than chunk * V, and applies d log p_y / d z = (onehot(y) - softmax(z)) / T: each slice of
    the lm_head gradient is written once, only the small [M, D] hidden gradient is accumulated
    (in fp32), and [M, V] never exists.
    On CUDA (COMPILE) the per-chunk math after each matmul is compiled (chunk_stats, slice_grad): the logits
    stay in the weight's dtype and are read once or twice, instead of a dozen fp32 passes; on CPU the
    in-place buffered passes below run, unchanged.
    """

    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, chunk_size, collision=False):
        chunk_size = chunk_size or chunk_rows(hidden.device, len(weight))
        logp, logz, entropy = (hidden.new_empty(len(hidden), dtype=torch.float32) for _ in range(3))
        sum_sq = hidden.new_empty(len(hidden) if collision else 0, dtype=torch.float32)  # sum pi^2, if asked
        ctx.compiled = compiled_here(hidden.device)
        if ctx.compiled:
            for i in range(0, len(hidden), chunk_size):
                j = slice(i, i + chunk_size)
                z = hidden[j].to(weight.dtype) @ weight.T  # [chunk, V] in the weight's dtype
                logz[j], logp[j], entropy[j], sq = fused("chunk_stats", z, tokens[j], temperature, collision)
                if collision:
                    sum_sq[j] = sq
        else:
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
        scale = grad_logp / temperature
        if ctx.compiled and compiled_here(hidden.device):  # not after a failed compile
            for v in range(0, weight.shape[0], width):
                w = weight[v:v + width]
                g = fused("slice_grad", h @ w.T, logz, scale, tokens - v, temperature, weight.dtype)
                torch.mm(g.T, h, out=grad_w[v:v + width])
                grad_h += g @ w
            return grad_h.to(hidden.dtype), grad_w, None, None, None, None
        buffer = hidden.new_empty(len(hidden) * width, dtype=torch.float32)  # one [M, V'] for every slice
        for v in range(0, weight.shape[0], width):
            w = weight[v:v + width]
            z = buffer[:len(hidden) * len(w)].view(len(hidden), len(w))
            torch.mm(h, w.T, out=z) if weight.dtype == z.dtype else z.copy_(h @ w.T)
            g = z.div_(temperature).sub_(logz[:, None]).exp_().mul_(-scale[:, None])  # -g softmax(z) / T
            column = tokens - v  # + g * onehot(y) / T, where y is in this slice (no host sync: no mask index)
            here = torch.where((column >= 0) & (column < len(w)), scale, 0.0)
            g.scatter_add_(1, column.clamp(0, len(w) - 1)[:, None], here[:, None])
            g = g.to(weight.dtype)
            torch.mm(g.T, h, out=grad_w[v:v + width])  # this slice of the lm_head gradient, once
            grad_h += g @ w  # in fp32: the sum over the slices
        return grad_h.to(hidden.dtype), grad_w, None, None, None, None


def token_logprobs_and_entropy(hidden, weight, tokens, temperature=1.0, chunk_size=128):
    """Log-prob (with grad) and entropy (no grad, nats) of each sampled token, from hidden states.

    hidden: [M, D] the final hidden state before each token; weight: [V, D] the lm_head weight;
    tokens: [M] the sampled ids. Logits are divided by the sampling temperature, as the sampler did.
    Works in chunks, so the [M, V] logits (let alone their fp32 log-softmax) never exist; equal to
    log_softmax(hidden @ weight.T / T) gathered at tokens, in values and gradients. chunk_size=None: the
    head's choice for the device and vocabulary (chunk_rows).
    """
    logp, entropy, _ = ChunkedHead.apply(hidden, weight, tokens, float(temperature), chunk_size)
    return logp, entropy
