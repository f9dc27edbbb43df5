"""head.py's device-sized chunk and its one per-chunk math, eager (as a CPU runs it) and compiled (as CUDA runs
it), checked on CPU.

The compiled path runs here through torch.compile's inductor on CPU (gcc): the same graphs CUDA compiles,
lowered to C++ instead of Triton. Tolerances, against the eager path of the same inputs and against
log_softmax in float64: fp32, relative error of the norm under 1e-5. bf16 inputs, compiled against eager:
under 1e-5 for log p, H and sum pi^2 (both round the logits to bf16, then work in fp32) and 1e-3 for the
gradients (each rounds (onehot - softmax) / T to bf16 before its matmuls: an element may land one bf16 ulp,
2^-8, apart);
against float64 log_softmax of the bf16-rounded logits, 1e-3 for the values and 1e-2 for the gradients (bf16
matmuls and a bf16 lm_head gradient).
"""
import warnings

import pytest
import torch

import head
from head import ChunkedHead, chunk_rows, token_logprobs_and_entropy

QWEN3_VOCAB = 151936


def test_the_chunk_is_cpus_at_any_vocabulary_and_within_an_eighth_of_the_naive_heads_memory_on_cuda():
    """CPU keeps its rows (CPU_CHUNK) at any vocabulary. CUDA: at the issue's shapes (16,384 tokens, V 151,936,
    hidden 2,048 and 4,096, bf16) the head's working memory, counted buffer by buffer as it runs eager (the
    larger of the two: compiled, it holds 4 x rows x V), is at most 1/8 of the naive head's 12 x tokens x V
    bytes; and no [rows, V] fp32 buffer passes 1 GiB."""
    for vocab in (512, 32000, QWEN3_VOCAB, 262144, 10 ** 6):
        assert chunk_rows("cpu", vocab) == head.CPU_CHUNK == chunk_rows(torch.device("cpu"), vocab)
        rows = chunk_rows("cuda", vocab)
        assert 128 <= rows <= 1024 and rows & (rows - 1) == 0  # a power of two
        assert rows * vocab * 4 <= 2 ** 30 or rows == 128
    rows, m = chunk_rows(torch.device("cuda", 0), QWEN3_VOCAB), 16384
    assert rows >= 1024  # a GPU-sized matmul (docs/performance.md has the measurements behind it)
    naive = 12 * m * QWEN3_VOCAB
    for hidden in (2048, 4096):
        forward = (2 + 3 * 4) * rows * QWEN3_VOCAB  # the bf16 matmul's output; z, its exp, their product in fp32
        width = rows * QWEN3_VOCAB // m
        # a slice's bf16 logits, g and the one-hot's where in fp32, its mask, g in bf16; the two gradients
        backward = (2 + 4 + 4 + 1 + 2) * m * width + 2 * QWEN3_VOCAB * hidden + (4 + 2) * m * hidden
        assert max(forward, backward) <= naive / 8, (hidden, max(forward, backward) / naive)


def _case(dtype, m=256, d=32, v=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(m, d, generator=g).to(dtype)
    w = (torch.randn(v, d, generator=g) * d ** -0.5 * 3).to(dtype)
    return h, w, torch.randint(v, (m,), generator=g), torch.randn(m, generator=g)


def _run(h, w, y, coef, temperature, chunk, collision):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, ent, sq = ChunkedHead.apply(h, w, y, temperature, chunk, collision)
    (logp * coef).sum().backward()
    return logp.detach(), ent, sq, h.grad, w.grad


def _reference(h, w, y, coef, temperature):
    """log_softmax in float64 of the same inputs, the logits rounded to the inputs' dtype as the head's matmul
    rounds them (the gradient passes the rounding unchanged): log p, H, sum pi^2 and both gradients."""
    dtype = h.dtype
    h, w = h.double().requires_grad_(), w.double().requires_grad_()
    a = h @ w.T
    a = a + (a.to(dtype).double() - a).detach()
    full = torch.log_softmax(a / temperature, -1)
    logp = full.gather(-1, y[:, None])[:, 0]
    (logp * coef.double()).sum().backward()
    pi = full.exp().detach()
    return logp.detach(), -(pi * full.detach()).sum(-1), (pi ** 2).sum(-1), h.grad, w.grad


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collision_on_or_off_gives_the_same_logp_entropy_and_gradients(dtype):
    """sum pi^2 is computed only when asked (collision=True), and asking changes nothing else, bit for bit;
    chunk_size=None is the CPU's chunk, bit for bit, through the backward too."""
    h, w, y, coef = _case(dtype, m=300)
    on, off, auto = (_run(h, w, y, coef, 0.7, head.CPU_CHUNK, True), _run(h, w, y, coef, 0.7, head.CPU_CHUNK, False),
                     _run(h, w, y, coef, 0.7, None, True))
    assert on[2].shape == (300,) and off[2].numel() == 0
    for k in (0, 1, 3, 4):
        assert torch.equal(on[k], off[k]) and torch.equal(on[k], auto[k]), k
    assert torch.equal(on[2], auto[2])
    logp, ent = token_logprobs_and_entropy(h, w, y, 0.7)
    assert torch.equal(logp, on[0]) and torch.equal(ent, on[1])


def test_a_failed_compile_warns_and_falls_back_to_eager(monkeypatch):
    """A compile that raises (no compiler, say) costs a warning, not the step: the call finishes with the eager
    per-chunk function, which every later call runs, with no second warning; the results are the eager head's."""
    monkeypatch.setattr(head, "COMPILE", "1")
    monkeypatch.setattr(head, "_compiled", {})

    def broken(fn):
        def run(*args):
            raise RuntimeError("no compiler here")
        return run
    monkeypatch.setattr(torch, "compile", broken)
    h, w, y, coef = _case(torch.float32)
    with pytest.warns(UserWarning, match="torch.compile of (chunk_stats|slice_grad) failed") as caught:
        got = _run(h, w, y, coef, 0.7, 128, True)
    assert len(caught) == 2  # once for each function: the forward's and the backward's
    assert list(head._compiled.values()) == [None, None]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = _run(h, w, y, coef, 0.7, 128, True)  # eager from now on: no second warning
    monkeypatch.setattr(head, "COMPILE", "0")
    want = _run(h, w, y, coef, 0.7, 128, True)
    for a, b, c in zip(got, again, want):
        assert torch.equal(a, c) and torch.equal(b, c)


def test_the_head_compiles_on_cuda_only_by_default(monkeypatch):
    monkeypatch.setattr(head, "COMPILE", "auto")
    assert not head.compiles("cpu") and head.compiles("cuda") and head.compiles(torch.device("cuda", 0))
    monkeypatch.setattr(head, "COMPILE", "0")
    assert not head.compiles("cuda")
    monkeypatch.setattr(head, "COMPILE", "1")
    assert head.compiles("cpu")


@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 0.7), (torch.bfloat16, 1.0)])
def test_the_eager_per_chunk_functions_match_the_reference(dtype, temperature):
    """chunk_stats and slice_grad uncompiled (what the compiled path computes, and its fallback) against
    float64 log_softmax of the same rounded inputs, and slice_grad's one-hot only inside its slice."""
    h, w, y, coef = _case(dtype, m=64, v=300)
    ref = _reference(h, w, y, coef, temperature)
    logz, logp, ent, sq = head.chunk_stats(h, w, y, temperature, True)
    assert head.chunk_stats(h, w, y, temperature, False)[3] is None
    scale = coef / temperature
    g = torch.cat([head.slice_grad(h, w[v:v + 128], logz, scale, y - v, temperature).double()
                   for v in range(0, 300, 128)], 1)
    for k, (got, want) in enumerate(zip((logp, ent, sq, g @ w.double(), g.T @ h.double()), ref)):
        assert _rel(got, want) < (1e-5 if dtype == torch.float32 else 1e-3 if k < 3 else 1e-2), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_eager_head_works_in_its_reused_buffers_as_in_fresh_ones(monkeypatch, dtype):
    """Eager, the head hands each chunk fp32 buffers (head.scratch; compiled, none), in either dtype:
    chunk_stats and slice_grad work in them (every entry written) and give, bit for bit, what they give in
    fresh tensors; so does the whole head, with a last chunk and a last vocabulary slice shorter than the
    others (300 rows in chunks of 128; slices of 436, 436, 152). Breaks if a buffer's stale rows or columns
    reach a result, or if the eager head stops working in its buffers (a fresh [128, V] tensor per chunk costs
    a CPU its page faults)."""
    h, w, y, coef = _case(dtype, m=300)
    monkeypatch.setattr(head, "COMPILE", "0")
    assert head.scratch(h, (2, 128, 1024)).shape == (2, 128, 1024)
    monkeypatch.setattr(head, "COMPILE", "1")
    assert head.scratch(h, (2, 128, 1024)) is None
    monkeypatch.setattr(head, "COMPILE", "0")
    space = torch.full((2, 64, 1024), float("nan"))
    fresh = head.chunk_stats(h[:64], w, y[:64], 0.7, True)
    reused = head.chunk_stats(h[:64], w, y[:64], 0.7, True, space)
    assert all(torch.equal(a, b) for a, b in zip(fresh, reused))
    assert not space.isnan().any()  # both buffers written: the logits and their exp
    logz, scale, out = fresh[0], coef[:64] / 0.7, torch.full((64, 100), float("nan"))
    y[:8] = torch.arange(0, 100, 13)  # some sampled ids inside this slice, the rest outside it
    g = head.slice_grad(h[:64], w[:100], logz, scale, y[:64], 0.7, out)
    assert torch.equal(g, head.slice_grad(h[:64], w[:100], logz, scale, y[:64], 0.7)) and g.dtype == dtype
    assert not out.isnan().any()
    reused = _run(h, w, y, coef, 0.7, 128, True)
    monkeypatch.setattr(head, "scratch", lambda hidden, shape: None)
    for k, (a, b) in enumerate(zip(reused, _run(h, w, y, coef, 0.7, 128, True))):
        assert torch.equal(a, b), k


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_head_matches_the_eager_head_and_the_reference(monkeypatch, dtype):
    """The whole head with its per-chunk math compiled by inductor (on CPU here; on CUDA the same graphs go
    to Triton) against the eager head and float64 log_softmax: values, sum pi^2 and gradients,
    collision on and off, a last chunk shorter than the others. Compiling takes about a minute here."""
    monkeypatch.setattr(head, "_compiled", {})
    h, w, y, coef = _case(dtype, m=300)
    ref = _reference(h, w, y, coef, 0.7)
    monkeypatch.setattr(head, "COMPILE", "0")
    eager = _run(h, w, y, coef, 0.7, 128, True)
    monkeypatch.setattr(head, "COMPILE", "1")
    compiled = _run(h, w, y, coef, 0.7, 128, True)
    off = _run(h, w, y, coef, 0.7, 128, False)
    assert set(head._compiled) == {head.chunk_stats, head.slice_grad} and None not in head._compiled.values()
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    for k, (a, b, c) in enumerate(zip(compiled, eager, ref)):
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert _rel(a, b) < (1e-5 if k < 3 else tol), (k, _rel(a, b))
        assert _rel(a, c) < (1e-5 if dtype == torch.float32 else 1e-3 if k < 3 else 1e-2), (k, _rel(a, c))
    for k in (0, 1, 3, 4):
        assert torch.equal(off[k], compiled[k]), k
    assert off[2].numel() == 0
