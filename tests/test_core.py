"""The algorithm's pure functions against hand-computed values and independent formulas."""
import math

import pytest
import torch

from head import ChunkedHead, token_logprobs_and_entropy
from analysis import GROUPS, SPURIOUS, entropy_change, logit_gradient_norm, loss_token_coef, token_groups
from rollout_is import rollout_is_weights
from stapo_core import (group_advantages, quantile, s2t_candidates, s2t_mask, s2t_silence, s2t_threshold,
                        stapo_loss)


# ---------------------------------------------------------------- group_advantages

def test_group_advantages_by_hand():
    # group 1: mean -0.5, unbiased std sqrt((1.5^2 + 3 * 0.5^2) / 3) = 1
    a = group_advantages(torch.tensor([1.0, -1, -1, -1, 1, 1, -1, -1]), 4)
    expect = torch.tensor([1.5, -0.5, -0.5, -0.5]) / (1 + 1e-6)
    # group 2: mean 0, unbiased std sqrt(4/3)
    s = math.sqrt(4 / 3)
    expect2 = torch.tensor([1, 1, -1, -1]) / (s + 1e-6)
    assert torch.allclose(a, torch.cat([expect, expect2]), atol=1e-7)


def test_group_advantages_equal_rewards_give_exact_zero():
    a = group_advantages(torch.tensor([1.0] * 4 + [-1.0] * 4 + [0.1] * 4 + [1e-3] * 4), 4)
    assert torch.equal(a, torch.zeros(16))


def test_group_advantages_eps_and_errors():
    a = group_advantages(torch.tensor([1.0, 0.0]), 2, eps=1.0)  # std = sqrt(0.5)
    assert torch.allclose(a, torch.tensor([0.5, -0.5]) / (math.sqrt(0.5) + 1.0))
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.tensor([1.0, 0.0]), 1)
    with pytest.raises(ValueError, match="multiple"):
        group_advantages(torch.tensor([1.0, 0.0, 1.0]), 2)


# ---------------------------------------------------------------- s2t_mask

def _s2t_inputs():
    p = torch.tensor([[0.001, 0.001, 0.5, 0.001, 0.001, 0.0021],
                      [0.001, 0.001, 0.001, 0.001, 0.001, 0.001]])
    ent = torch.tensor([[0.1, 0.5, 0.2, 0.9, 0.3, 0.05],
                        [0.1, 0.1, 0.1, 0.1, 0.1, 0.1]])
    return p.log(), ent


def test_s2t_mask_by_hand():
    logp, ent = _s2t_inputs()
    valid = torch.ones(2, 6, dtype=torch.bool)
    m = s2t_mask(logp, ent, torch.tensor([1.0, -1.0]), valid)
    # row 0 candidates (p < 0.002): cols 0, 1, 3, 4 with H = .1 .5 .9 .3
    # 0.75-quantile of [.1 .3 .5 .9], linear: .5 + .25 * (.9 - .5) = .6  ->  silenced H < .6: cols 0, 1, 4
    # row 1 has A < 0: never a candidate
    assert m.tolist() == [[True, True, False, False, True, False], [False] * 6]


def test_s2t_mask_respects_valid_and_token_advantages():
    logp, ent = _s2t_inputs()
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[0, 1] = False  # padding is never a candidate: candidates .1 .9 .3 -> q = .3 + .5 * .6 = .6
    adv = torch.ones(2, 6)
    adv[1, :3] = 0.0  # A = 0 is not > 0
    m = s2t_mask(logp, ent, adv, valid)
    # candidates: row0 cols 0 3 4 (H .1 .9 .3), row1 cols 3 4 5 (H .1): pooled [.1 .1 .1 .1 .3 .9]
    # 0.75-quantile: pos 3.75 -> .1 + .75 * (.3 - .1) = .25
    assert m.tolist() == [[True, False, False, False, False, False],
                          [False, False, False, True, True, True]]


def test_s2t_mask_empty_candidates_and_tau_h_override():
    logp, ent = _s2t_inputs()
    valid = torch.ones(2, 6, dtype=torch.bool)
    assert not s2t_mask(logp, ent, torch.tensor([-1.0, 0.0]), valid).any()
    assert not s2t_mask(torch.zeros(2, 6), ent, torch.ones(2), valid).any()  # p = 1
    m = s2t_mask(logp, ent, torch.tensor([1.0, -1.0]), valid, tau_h=0.35)
    assert m.tolist() == [[True, False, False, False, True, False], [False] * 6]
    m = s2t_mask(logp, ent, torch.tensor([1.0, -1.0]), valid, tau_p=0.6, q=0.0)
    assert not m.any()  # q = 0: tau_h is the minimum candidate entropy, and H < min never holds


def test_a_data_parallel_threshold_in_three_calls_equals_one_process():
    """Two "ranks" hold rows 0-1 and 2-5 of one batch. Candidates' entropies per rank, gathered, give
    s2t_threshold's tau_h; each rank's s2t_mask with it, and s2t_silence of its candidates with it, equal one
    process's mask of the whole batch.
    A per-rank threshold (s2t_mask without tau_h on each part) differs here, so the test can fail."""
    g = torch.Generator().manual_seed(3)
    logp, ent = -torch.rand(6, 7, generator=g) * 9, torch.rand(6, 7, generator=g) * 3
    adv, valid = torch.randn(6, generator=g), torch.rand(6, 7, generator=g) < 0.9
    whole = s2t_mask(logp, ent, adv, valid, tau_p=0.01)
    parts = [slice(0, 2), slice(2, 6)]
    gathered = torch.cat([ent[r][s2t_candidates(logp[r], adv[r], valid[r], 0.01)] for r in parts])
    tau_h = s2t_threshold(gathered)
    assert torch.equal(torch.cat([s2t_mask(logp[r], ent[r], adv[r], valid[r], 0.01, tau_h=tau_h)
                                  for r in parts]), whole)
    assert torch.equal(torch.cat([s2t_silence(s2t_candidates(logp[r], adv[r], valid[r], 0.01), ent[r], tau_h)
                                  for r in parts]), whole)  # the three calls of the recipe, the last alone
    per_rank = torch.cat([s2t_mask(logp[r], ent[r], adv[r], valid[r], 0.01) for r in parts])
    assert not torch.equal(per_rank, whole) and whole.any()
    assert s2t_threshold(torch.zeros(0)) is None
    assert not s2t_mask(logp, ent, -adv.abs(), valid, tau_h=None).any()  # no candidate anywhere


def test_candidates_of_a_fresh_model_are_most_positive_tokens():
    """p ~ 1/V: below tau_p = 0.002 for V = 151,936 (and for V = 512), so every A > 0 token is one; and with
    entropies spread as a fresh model's are, q = 0.75 silences three quarters of them (the README's warning to
    a copier who tries the mask on random weights). Breaks with a candidate test on H, or tau_h off its
    quantile."""
    logp = torch.full((2, 4), -math.log(151_936))
    assert s2t_candidates(logp, torch.tensor([1.0, -1.0]), torch.ones(2, 4)).tolist() == [[True] * 4, [False] * 4]
    g = torch.Generator().manual_seed(0)
    logp, entropy = torch.full((64, 32), -math.log(512)), 6.0 + 0.1 * torch.rand(64, 32, generator=g)
    adv, valid = torch.tensor([1.0, -1.0]).repeat(32), torch.ones(64, 32, dtype=torch.bool)
    silenced = s2t_mask(logp, entropy, adv, valid)
    assert silenced.sum() / (valid & (adv[:, None] > 0)).sum() == pytest.approx(0.75, abs=0.01)


# ---------------------------------------------------------------- stapo_loss

def _by_hand(ratio, a, eps_low=0.2, eps_high=0.28, c=10.0):
    """The per-token objective with scalar math, written out case by case."""
    l = max(-ratio * a, -min(max(ratio, 1 - eps_low), 1 + eps_high) * a)
    return min(l, -c * a) if (a < 0 and c is not None) else l


CASES = [  # (ratio, A, per-token loss by hand, d loss / d logp by hand)
    (0.5, 1.0, -0.5, -0.5),      # A > 0, inside: -r A, gradient -r A
    (1.5, 1.0, -1.28, 0.0),      # A > 0, above 1 + eps_high: clipped, no gradient
    (0.5, -1.0, 0.8, 0.0),       # A < 0, below 1 - eps_low: clipped, no gradient
    (1.5, -1.0, 1.5, 1.5),       # A < 0, above: unclipped -r A (max picks it)
    (20.0, -1.0, 10.0, 0.0),     # A < 0, r > c: dual clip caps at -c A
    (30.0, -0.5, 5.0, 0.0),
    (0.9, 2.0, -1.8, -1.8),
]


@pytest.mark.parametrize("ratio,a,loss,grad", CASES)
def test_stapo_loss_regions_by_hand(ratio, a, loss, grad):
    assert _by_hand(ratio, a) == pytest.approx(loss)
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    out, _ = stapo_loss(logp, torch.zeros(1, 1), torch.tensor([a]), torch.ones(1, 1, dtype=torch.bool))
    out.backward()
    assert out.item() == pytest.approx(loss, rel=1e-6)
    assert logp.grad.item() == pytest.approx(grad, rel=1e-6, abs=1e-7)


def test_stapo_loss_dual_clip_off():
    logp = torch.tensor([[math.log(20.0)]])
    out, _ = stapo_loss(logp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1, dtype=torch.bool),
                        clip_c=None)
    assert out.item() == pytest.approx(20.0)


def _batch(seed=0, n=6, t=9, depth=3, noise=0.4):
    """A padded batch: old log-probs in (-depth, 0], logp = old + noise (with grad), adv, valid."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g) * depth
    logp = (old + torch.randn(n, t, generator=g) * noise).requires_grad_()
    adv = torch.randn(n, generator=g)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    valid = torch.arange(t)[None, :] < lengths[:, None]
    return logp, old, adv, valid


def test_stapo_loss_equals_dapo_token_mean_when_nothing_silenced():
    logp, old, adv, valid = _batch()
    loss, stats = stapo_loss(logp, old, adv, valid)
    total, count = 0.0, 0
    for i in range(valid.shape[0]):
        for t in range(valid.shape[1]):
            if valid[i, t]:
                total += _by_hand(math.exp(logp[i, t].item() - old[i, t].item()), adv[i].item())
                count += 1
    assert loss.item() == pytest.approx(total / count, rel=1e-5)
    assert stats["kept"] == count


def test_stapo_loss_denominator_counts_only_kept_tokens():
    logp, old, adv, valid = _batch(1)
    silenced = torch.zeros_like(valid)
    silenced[0, 0] = silenced[2, 0] = True
    keep = valid & ~silenced
    loss, stats = stapo_loss(logp, old, adv, keep)
    per = [_by_hand(math.exp(logp[i, t].item() - old[i, t].item()), adv[i].item())
           for i in range(6) for t in range(9) if keep[i, t]]
    assert stats["kept"] == len(per) == int(valid.sum()) - 2
    assert loss.item() == pytest.approx(sum(per) / len(per), rel=1e-5)
    loss2, _ = stapo_loss(logp, old, adv, keep, num_tokens=1000)
    assert loss2.item() == pytest.approx(sum(per) / 1000, rel=1e-5)


def test_silenced_and_padded_tokens_get_exactly_zero_gradient():
    logp, old, adv, valid = _batch(2)
    with torch.no_grad():  # garbage in the padding: exp(200 - (-200)) would overflow to inf
        logp[~valid] = 200.0
        old[~valid] = -200.0
    silenced = torch.zeros_like(valid)
    silenced[valid.nonzero()[:3].T.unbind()] = True
    loss, _ = stapo_loss(logp, old, adv.abs() + 0.1, valid & ~silenced)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.equal(logp.grad[~valid | silenced], torch.zeros(int((~valid | silenced).sum())))
    assert (logp.grad[valid & ~silenced] != 0).any()


def test_all_silenced_gives_finite_zero_loss():
    logp, old, adv, valid = _batch(3)
    loss, stats = stapo_loss(logp, old, adv, torch.zeros_like(valid))
    loss.backward()
    assert loss.item() == 0.0 and stats["kept"] == 0
    assert torch.equal(logp.grad, torch.zeros_like(logp))


def test_all_correct_group_zero_advantage_finite_loss():
    logp, old, _, valid = _batch(4)
    adv = group_advantages(torch.ones(6), 6)
    keep = valid & ~s2t_mask(logp.detach(), torch.rand(6, 9), adv, valid)
    loss, _ = stapo_loss(logp, old, adv, keep)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros_like(logp))


def test_stapo_loss_clip_fractions():
    ratios = torch.tensor([[0.5, 1.5, 0.5, 1.5, 1.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
    _, stats = stapo_loss(ratios.log(), torch.zeros(1, 5), adv, torch.ones(1, 5, dtype=torch.bool))
    assert stats == {"clip_low": 1 / 5, "clip_high": 1 / 5, "kept": 5}


def test_float_keep_weights_give_sequence_mean():
    logp, old, adv, valid = _batch(5)
    w = valid / valid.sum(1, keepdim=True)  # GRPO: token mean per sequence, then mean over sequences
    loss, _ = stapo_loss(logp, old, adv, w, num_tokens=valid.shape[0], eps_high=0.2, clip_c=None)
    seq = []
    for i in range(6):
        per = [_by_hand(math.exp(logp[i, t].item() - old[i, t].item()), adv[i].item(), 0.2, 0.2, None)
               for t in range(9) if valid[i, t]]
        seq.append(sum(per) / len(per))
    assert loss.item() == pytest.approx(sum(seq) / 6, rel=1e-5)


# ---------------------------------------------------------------- token_logprobs_and_entropy

@pytest.mark.parametrize("temperature,chunk", [(1.0, 8), (0.7, 5), (1.3, 1000)])
def test_chunked_equals_naive_values_and_gradients(temperature, chunk):
    g = torch.Generator().manual_seed(0)
    m, d, v = 37, 16, 1000
    h = torch.randn(m, d, generator=g).requires_grad_()
    w = torch.randn(v, d, generator=g).requires_grad_()
    tok = torch.randint(v, (m,), generator=g)
    coef = torch.randn(m, generator=g)

    full = torch.log_softmax(h @ w.T / temperature, -1)
    logp_ref = full.gather(-1, tok[:, None]).squeeze(-1)
    ent_ref = -(full.exp() * full).sum(-1)
    gh_ref, gw_ref = torch.autograd.grad((logp_ref * coef).sum(), (h, w))

    logp, ent = token_logprobs_and_entropy(h, w, tok, temperature, chunk_size=chunk)
    gh, gw = torch.autograd.grad((logp * coef).sum(), (h, w))
    assert not ent.requires_grad
    for a, b in [(logp, logp_ref), (ent, ent_ref), (gh, gh_ref), (gw, gw_ref)]:
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()


def test_chunked_without_grad_and_empty():
    h, w = torch.randn(4, 8), torch.randn(50, 8)
    with torch.no_grad():
        logp, ent = token_logprobs_and_entropy(h, w, torch.tensor([1, 2, 3, 4]))
    assert logp.shape == ent.shape == (4,) and (logp < 0).all() and (ent > 0).all()
    logp, ent = token_logprobs_and_entropy(h[:0], w, torch.tensor([], dtype=torch.long))
    assert logp.shape == (0,)


def test_entropy_of_uniform_logits_is_log_v():
    h, w = torch.zeros(3, 4), torch.randn(64, 4)
    _, ent = token_logprobs_and_entropy(h, w, torch.tensor([0, 1, 2]))
    assert torch.allclose(ent, torch.full((3,), math.log(64)))


# ---------------------------------------------------------------- precision, size and the copyable contract

def test_quantile_matches_torch_and_takes_more_than_2_pow_24_values():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(1001, generator=g, dtype=dtype)
        for q in (0.0, 0.2, 0.75, 0.8, 1.0):
            assert torch.equal(quantile(x, q), torch.quantile(x, q)), (dtype, q)
    big = torch.arange(2 ** 24 + 1, dtype=torch.float32)  # torch.quantile refuses this many (entropy20's case)
    assert quantile(big, 0.8).item() == pytest.approx(0.8 * 2 ** 24, abs=1)
    with pytest.raises(ValueError, match="empty"):
        quantile(torch.zeros(0), 0.5)


def test_s2t_mask_threshold_in_the_input_precision():
    # tau_h = (1 + (1 + 4e-12)) / 2 in float64 sits above 1.0; cast to float32 it is 1.0, and the token
    # with H = 1.0 would no longer satisfy H < tau_h
    ent = torch.tensor([[1.0, 1.0 + 4e-12]], dtype=torch.float64)
    logp = torch.full((1, 2), math.log(1e-3), dtype=torch.float64)
    m = s2t_mask(logp, ent, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool), q=0.5)
    assert m.tolist() == [[True, False]]


def test_stapo_loss_default_denominator_is_keep_sum_for_float_weights():
    logp, old, adv, valid = _batch(6)
    w = valid / valid.sum(1, keepdim=True)  # GRPO's weights sum to the number of sequences, 6
    loss, _ = stapo_loss(logp, old, adv, w, eps_high=0.2, clip_c=None)
    ref, _ = stapo_loss(logp, old, adv, w, num_tokens=6, eps_high=0.2, clip_c=None)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)


def test_stapo_loss_small_num_tokens_is_used_as_given():
    logp, old, adv, valid = _batch(7)
    keep = torch.zeros_like(valid)
    keep[0, 0] = True
    one, _ = stapo_loss(logp, old, adv, keep, num_tokens=1)
    half, _ = stapo_loss(logp, old, adv, keep, num_tokens=0.5)
    assert half.item() == pytest.approx(2 * one.item(), rel=1e-6)
    zero, _ = stapo_loss(logp, old, adv, torch.zeros_like(valid), num_tokens=0)
    assert zero.item() == 0.0
    with pytest.raises(ValueError, match="num_tokens"):
        stapo_loss(logp, old, adv, keep, num_tokens=-1)


@pytest.mark.parametrize("count", [0.5, 1, 13])
def test_a_tensor_num_tokens_is_a_python_numbers_equal_and_a_zero_one_gives_nothing(count):
    """A 0-dim tensor count (all-reduced, the contract's recipe) gives the loss and gradient of the same Python
    number, bit for bit, float or integer; a zero one, with tokens kept, gives a zero loss and a zero gradient
    (no inf, no NaN), as the number 0 does, and so does a negative one (its sign is not read: <= 0 gives the
    zero loss). Breaks with a tensor divided by unclamped, or kept out of the zero case."""
    logp, old, adv, valid = _batch(7)
    for n in (torch.tensor(float(count)), torch.tensor(count) if count == int(count) else None):
        if n is None:
            continue
        (got, got_grad), (want, want_grad) = (
            (loss, torch.autograd.grad(loss, logp)[0])
            for loss, _ in (stapo_loss(logp, old, adv, valid, num_tokens=x) for x in (n, count)))
        assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
    for zero in (torch.tensor(0.0), torch.tensor(0), 0, torch.tensor(-3.0)):  # a tensor's sign is not read
        loss, _ = stapo_loss(logp, old, adv, valid, num_tokens=zero)
        (grad,) = torch.autograd.grad(loss, logp)
        assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))


def test_stapo_loss_upcasts_bf16_inputs():
    logp, old, adv, valid = _batch(8)
    lo = logp.detach().bfloat16(), old.bfloat16(), adv.bfloat16()
    got, _ = stapo_loss(*lo, valid)
    want, _ = stapo_loss(*(t.float() for t in lo), valid)  # the same bf16 values, computed in fp32
    assert got.dtype == torch.float32 and got.item() == pytest.approx(want.item(), rel=1e-6)


def test_stapo_loss_huge_log_ratio_gives_a_finite_gradient():
    logp = torch.tensor([[100.0, -100.0, 0.1]], requires_grad=True)
    loss, _ = stapo_loss(logp, torch.zeros(1, 3), torch.tensor([[-1.0, 1.0, 1.0]]), torch.ones(1, 3, dtype=torch.bool))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and logp.grad[0, 2] != 0


def test_stapo_loss_packed_tokens_equal_the_padded_batch():
    logp, old, adv, valid = _batch(9)
    padded, _ = stapo_loss(logp, old, adv, valid)
    token_adv = adv[:, None].expand_as(logp)
    packed, _ = stapo_loss(logp[valid], old[valid], token_adv[valid], torch.ones(int(valid.sum()), dtype=torch.bool))
    assert packed.item() == pytest.approx(padded.item(), rel=1e-6)


def test_stapo_loss_bad_shapes_are_named():
    logp, old, adv, valid = _batch(10)
    with pytest.raises(ValueError, match=r"must share one shape"):
        stapo_loss(logp, old[:, :3], adv, valid)
    with pytest.raises(ValueError, match=r"adv must be"):
        stapo_loss(logp[valid], old[valid], adv, torch.ones(int(valid.sum()), dtype=torch.bool))


def test_chunked_head_bf16_gradient_accumulates_in_fp32():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(4096, 64, generator=g)
    w = torch.randn(512, 64, generator=g) * 0.1
    y = torch.randint(0, 512, (4096,), generator=g)
    exact = torch.func.grad(lambda w: torch.log_softmax(h.double() @ w.T, -1).gather(-1, y[:, None]).sum())(w.double())
    wb = w.bfloat16().requires_grad_()
    logp, _ = token_logprobs_and_entropy(h.bfloat16(), wb, y, chunk_size=32)
    logp.sum().backward()
    err = (wb.grad.double() - exact).norm() / exact.norm()
    assert wb.grad.dtype == torch.bfloat16 and err < 5e-3  # accumulated in bf16 over 128 chunks: 1.25e-2
    # fp32 master weights with bf16 hidden states (autocast): gradients in each input's own dtype
    wf = w.clone().requires_grad_()
    hb = h.bfloat16().requires_grad_()
    logp, _ = token_logprobs_and_entropy(hb, wf, y, chunk_size=32)
    logp.sum().backward()
    assert wf.grad.dtype == torch.float32 and hb.grad.dtype == torch.bfloat16


def test_adv_may_be_n_n1_or_nt():
    """[N] (one advantage per sequence), [N, 1] (TRL's advantages.unsqueeze(1)) and [N, T] agree."""
    logp, old, adv, valid = _batch(11)
    want, _ = stapo_loss(logp, old, adv, valid)
    for shaped in (adv[:, None], adv[:, None].expand_as(logp)):
        got, _ = stapo_loss(logp, old, shaped, valid)
        assert got.item() == want.item()
    ent = torch.rand(logp.shape)
    m = s2t_mask(logp.detach(), ent, adv, valid, tau_p=0.5)
    assert torch.equal(s2t_mask(logp.detach(), ent, adv[:, None], valid, tau_p=0.5), m) and m.any()
    with pytest.raises(ValueError, match=r"adv must be \[N\], \[N, 1\] or \[N, T\]"):
        stapo_loss(logp, old, adv[:, None, None], valid)


def test_without_the_dual_clip_and_the_clamp_it_is_the_plain_token_mean():
    """clip_c=None, max_log_ratio=inf: -clip(r)A / -rA at any ratio, e^25 included (the default clamps it
    at e^20 and the dual clip caps A < 0 at 10|A|)."""
    logp = torch.tensor([[25.0, 0.1, -0.1]], requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0, -1.0]])
    loss, _ = stapo_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3, dtype=torch.bool), clip_c=None,
                         max_log_ratio=float("inf"))
    per = [_by_hand(math.exp(x), a, c=None) for x, a in zip([25.0, 0.1, -0.1], [-1.0, 1.0, -1.0])]
    assert loss.item() == pytest.approx(sum(per) / 3, rel=1e-6)
    default, _ = stapo_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3, dtype=torch.bool))
    assert default.item() == pytest.approx((10.0 + per[1] + per[2]) / 3, rel=1e-6)



# ---------------------------------------------------------------- the token-level analysis

def _head_case(seed=0, m=9, d=6, v=11, temperature=0.7):
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(m, d, generator=g, dtype=torch.float64), torch.randn(v, d, generator=g, dtype=torch.float64)
    return h, w * 2, torch.randint(v, (m,), generator=g), temperature


def _direct_stats(a, y, t):
    """log pi_y, H, sum pi^2 from logits a, in their own precision."""
    lp = torch.log_softmax(a / t, -1)
    pi = lp.exp()
    return lp.gather(-1, y[:, None])[:, 0], -(pi * lp).sum(-1), (pi ** 2).sum(-1)


def test_the_heads_statistics_are_h_and_collision():
    h, w, y, t = _head_case()
    logp, ent, collision = ChunkedHead.apply(h.float(), w.float(), y, t, 4, True)  # chunks of 4 tokens, fp32
    want = _direct_stats(h @ w.T, y, t)
    assert collision.shape == ent.shape == (len(y),)
    for got, exact in zip([logp, ent, collision], want):
        assert torch.allclose(got.double(), exact, atol=1e-5), (got, exact)
    assert (collision >= torch.exp(-ent) - 1e-6).all()  # sum pi^2 >= e^-H
    alone = ChunkedHead.apply(h.float(), w.float(), y, t, 4)  # sum pi^2 not asked: none computed
    assert torch.equal(alone[0], logp) and torch.equal(alone[1], ent) and alone[2].numel() == 0


def test_the_gradient_norm_identity_against_autograd():
    """||d (w log pi_y) / d a||^2 = w^2 (1 - 2 pi_y + sum pi^2) / T^2, for logits a of a small vocabulary."""
    h, w, y, t = _head_case(1)
    a = (h @ w.T).requires_grad_()
    weight = torch.randn(len(y), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    lp = torch.log_softmax(a / t, -1).gather(-1, y[:, None])[:, 0]
    (grad,) = torch.autograd.grad((weight * lp).sum(), a)  # row i depends on token i only
    logp, _, collision = _direct_stats(a.detach(), y, t)
    assert torch.allclose(logit_gradient_norm(logp, collision, weight, t), grad.norm(dim=-1), rtol=1e-10)


def test_the_entropy_change_is_the_papers_lemma_a_natural_gradient_step():
    """The natural-gradient step logit_y += eta * w changes H by eta * entropy_change (the lemma's
    -eta w pi_y (log pi_y + H)), to first order, in both directions. Breaks with the plain-gradient form
    (the extra sum pi^2 (log pi + H) term), or a sign flipped."""
    h, w, y, t = _head_case(2)
    z = h @ w.T / t  # the softmax's own logits: pi = softmax(z)
    weight = torch.tensor([1.0, -1.0, 2.0, -0.5, 1.0, 1.0, -1.0, 0.3, -2.0], dtype=torch.float64)
    eta = 1e-7
    stepped = z.clone()
    stepped[torch.arange(len(y)), y] += eta * weight
    logp, ent, _ = _direct_stats(z, y, 1.0)
    actual = _direct_stats(stepped, y, 1.0)[1] - ent
    predicted = eta * entropy_change(logp, ent, weight)
    assert torch.allclose(actual, predicted, rtol=1e-5, atol=1e-15), (actual, predicted)
    assert (predicted > 0).any() and (predicted < 0).any()  # both directions occur in this case


def test_the_entropy_change_where_the_two_forms_disagree_in_sign():
    """pi = (0.508, 0.34, 0.025 x 6), y = 1, A = +1 (H = 1.264): the lemma gives -0.34 (log 0.34 + H) = -0.063,
    the entropy falls; the plain-gradient form gives +0.101, it rises. Breaks with the plain-gradient form."""
    pi = torch.tensor([0.508, 0.34] + [0.025] * 6, dtype=torch.float64)
    ent = -(pi * pi.log()).sum()
    change = entropy_change(pi[1].log(), ent, torch.tensor(1.0, dtype=torch.float64))
    assert change.item() == pytest.approx(-0.34 * (math.log(0.34) + ent.item()))
    assert change.item() == pytest.approx(-0.0630, abs=5e-4)
    plain = -(pi[1] * (pi[1].log() + ent) - (pi ** 2 * (pi.log() + ent)).sum())
    assert plain.item() == pytest.approx(0.101, abs=5e-4)


def _clipped_batch():
    """Logits over a vocabulary of 7 at 3 x 5 positions, and old log-probs set so that every branch of the loss
    occurs: ratios of e^-1, 1, e^0.5, e^3 and e^25 (beyond the clamp) against A of +1.5, -0.7 and 0; keep
    with float weights, a zero (padding) and the denominator of another rank's share."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 5, 7, generator=g, dtype=torch.float64) * 2).requires_grad_()
    y = torch.randint(7, (3, 5), generator=g)
    t = 0.8
    logp = torch.log_softmax(logits / t, -1).gather(-1, y[..., None])[..., 0]
    shift = torch.tensor([-1.0, 0.0, 0.5, 3.0, 25.0], dtype=torch.float64)
    old = logp.detach() - shift
    adv = torch.tensor([1.5, -0.7, 0.0], dtype=torch.float64)
    keep = torch.tensor([[1.0, 0.5, 1.0, 2.0, 1.0], [1.0, 1.0, 0.0, 1.0, 1.0], [1.0] * 5], dtype=torch.float64)
    return logits, y, t, logp, old, adv, keep


def test_the_loss_token_coef_is_the_gradient_of_the_loss_with_the_clips_active():
    """loss_token_coef equals autograd's d stapo_loss / d logp token by token, and its logit_gradient_norm the
    norm of autograd's gradient on each position's logits: zero where clip-higher (A > 0, r = e^0.5 > 1.28), the
    lower clip (A < 0, r = e^-1 < 0.8), the dual clip (A < 0, r = e^3 > 10) or the clamp (e^25) holds the term,
    -A r keep / n elsewhere. Breaks with the unclipped weight r * A, a missing keep, or another denominator."""
    logits, y, t, logp, old, adv, keep = _clipped_batch()
    n = 17.5  # the kept count of the whole mini-batch on all ranks, not this batch's
    loss, _ = stapo_loss(logp, old, adv, keep, n)
    grad_logp, grad_logits = torch.autograd.grad(loss, [logp, logits])
    weight = loss_token_coef(logp, old, adv, keep, n)
    assert torch.allclose(weight.double(), grad_logp, rtol=1e-6, atol=1e-12), (weight, grad_logp)
    zeroed = [(0, 2), (0, 3), (0, 4), (1, 0), (1, 2), (1, 3), (1, 4)]  # the clips, padding, the clamp
    assert all(weight[c] == 0 for c in zeroed) and all(weight[2] == 0)  # row 2: A = 0
    assert weight[0, 1].item() == pytest.approx(-1.5 * 1.0 * 0.5 / n) and weight[1, 1] != 0
    pi = torch.softmax(logits.detach() / t, -1)
    collision = (pi ** 2).sum(-1)
    norm = logit_gradient_norm(logp.detach(), collision, weight.double(), t)
    assert torch.allclose(norm, grad_logits.norm(dim=-1), rtol=1e-6, atol=1e-12)


def test_the_loss_token_coef_without_the_dual_clip_and_with_the_default_count():
    """clip_c=None: the A < 0 token at r = e^3 is live (-A r keep / n); num_tokens=None divides by keep's sum.
    Breaks if the dual clip were applied regardless of clip_c."""
    logits, y, t, logp, old, adv, keep = _clipped_batch()
    loss, _ = stapo_loss(logp, old, adv, keep, clip_c=None)
    (grad,) = torch.autograd.grad(loss, logp)
    weight = loss_token_coef(logp, old, adv, keep, clip_c=None)
    assert torch.allclose(weight.double(), grad, rtol=1e-6, atol=1e-12)
    assert weight[1, 3] > 0


def test_the_spurious_group_is_the_silenced_set():
    """On random batches where S2T runs (candidates, and a tau_h pooled with another rank's entropies), the
    taxonomy's SPURIOUS group (A > 0, p < tau_p, H < tau_h) is exactly s2t_mask's silenced set, and the eight
    groups partition the valid tokens with A != 0. Breaks with the median H (or any cut but S2T's tau_h) as
    the entropy split."""
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        logp = -torch.rand(6, 20, generator=g) * 6
        ent = torch.rand(6, 20, generator=g) * 2
        adv = torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0, -0.3])
        valid = torch.arange(20) < torch.randint(5, 21, (6, 1), generator=g)
        other_rank = torch.rand(7, generator=g) * 2
        candidates = s2t_candidates(logp, adv, valid, tau_p=0.05)
        tau_h = s2t_threshold(torch.cat([ent[candidates], other_rank]), 0.75)
        silenced = s2t_mask(logp, ent, adv, valid, tau_p=0.05, tau_h=tau_h)
        groups = token_groups(logp.exp() < 0.05, adv[:, None].expand_as(logp), ent, valid, tau_h)
        assert silenced.any() and torch.equal(groups[SPURIOUS], silenced)
        count = sum(m.int() for m in groups.values())
        assert torch.equal(count, (valid & (adv[:, None] != 0)).int()) and list(groups) == GROUPS


def test_rollout_is_weights_by_hand():
    """Sampler log-probs off the trainer's by a known amount: token rho = e^delta, sequence rho = e^(sum delta)."""
    old = torch.zeros(2, 3)
    sampler = -torch.tensor([[0.5, -0.2, 1.5], [0.1, 0.2, 9.0]])  # rho = e^0.5, e^-0.2, e^1.5 | e^0.1, e^0.2, pad
    valid = torch.tensor([[True, True, True], [True, True, False]])
    w, rho = rollout_is_weights(old, sampler, valid, "token", cap=2.0)
    e = math.exp
    assert torch.allclose(w, torch.tensor([[e(0.5), e(-0.2), 2.0], [e(0.1), e(0.2), 0.0]]))
    assert torch.allclose(rho.float(), torch.tensor([e(0.5), e(-0.2), e(1.5), e(0.1), e(0.2)]))  # valid tokens'
    w, _ = rollout_is_weights(old, sampler, valid, "token", cap=2.0, mode="mask")
    assert torch.allclose(w, torch.tensor([[e(0.5), e(-0.2), 0.0], [e(0.1), e(0.2), 0.0]]))
    w, rho = rollout_is_weights(old, sampler, valid, "sequence", cap=3.0)  # row 0: e^1.8 > 3; row 1: e^0.3
    assert torch.allclose(rho.float(), torch.tensor([e(1.8), e(0.3)]))  # one per response
    assert torch.allclose(w, torch.tensor([[3.0] * 3, [e(0.3), e(0.3), 0.0]]))
    w, _ = rollout_is_weights(old, sampler, valid, "sequence", cap=3.0, mode="mask")
    assert torch.allclose(w, torch.tensor([[0.0] * 3, [e(0.3), e(0.3), 0.0]]))
    w, rho = rollout_is_weights(old, None, valid, "none")  # off: 1 at each valid token, the sampler unread
    assert torch.equal(w, valid.float()) and rho.numel() == 0


def _loss_case():
    g = torch.Generator().manual_seed(3)
    logp = (-torch.rand(3, 5, generator=g) * 3).requires_grad_()
    old = logp.detach() + torch.randn(3, 5, generator=g) * 0.3
    valid = torch.rand(3, 5, generator=g) < 0.8
    return logp, old, torch.tensor([1.0, -0.5, 0.7]), valid


@pytest.mark.parametrize("num_tokens", [None, 7, 0, torch.tensor(7.0), torch.tensor(0.0), torch.tensor(9)])
def test_stapo_loss_never_waits_on_the_device(num_tokens):
    """No call reads a tensor back to the host (.item(), float(), int(), bool() of a tensor: each is one
    aten._local_scalar_dense or is_nonzero, a device-to-host copy and a sync on a GPU), with num_tokens None, a
    Python number or a 0-dim tensor (an all-reduced count, as the contract's recipe gives it: float or
    integer), and the statistics come back as tensors. Breaks with float()/int() statistics,
    float(keep.sum()), or a tensor count compared on the host (`num_tokens > 0` in an if)."""
    from support import HostReads
    logp, old, adv, valid = _loss_case()
    with HostReads() as reads:
        loss, stats = stapo_loss(logp, old, adv, valid, num_tokens)
        loss.backward()
    assert reads.seen == [] and all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in stats.values())
    assert int(stats["kept"]) == int(valid.sum())


def test_stapo_loss_compiles_as_one_graph():
    """torch.compile(fullgraph=True) captures the whole loss (a graph break, such as a read of a tensor into
    Python, is an error there), and the compiled loss, gradient and statistics equal the eager ones, for
    num_tokens None, a Python number and a 0-dim tensor (a count of 0 too)."""
    logp, old, adv, valid = _loss_case()
    compiled = torch.compile(stapo_loss, fullgraph=True, backend="aot_eager")
    for num_tokens in (None, 9, 7, torch.tensor(7.0), torch.tensor(0.0)):
        want, want_stats = stapo_loss(logp, old, adv, valid, num_tokens)
        (want_grad,) = torch.autograd.grad(want, logp)
        got, got_stats = compiled(logp, old, adv, valid, num_tokens)
        (got_grad,) = torch.autograd.grad(got, logp)
        assert torch.allclose(got, want) and torch.allclose(got_grad, want_grad)
        assert all(torch.equal(got_stats[k], want_stats[k]) for k in want_stats)


def test_shapes_that_would_broadcast_are_refused_by_name():
    """s2t_candidates checks its shapes as stapo_loss does (packed [M] log-probs with [N] advantages would
    broadcast, or fail in torch's words), and a count given as a [1] tensor (what all_reduce of
    torch.tensor([n]) gives) is refused: it would make the loss [1]. Breaks if either check goes."""
    logp, adv, valid = torch.zeros(3, 4), torch.ones(3), torch.ones(3, 4, dtype=torch.bool)
    for bad_adv, bad_valid in ((torch.ones(4), valid), (adv, valid[:, :3]), (torch.ones(3, 2), valid)):
        with pytest.raises(ValueError, match=r"s2t_candidates: .*got"):
            s2t_candidates(logp, bad_adv, bad_valid)
    with pytest.raises(ValueError, match=r"s2t_candidates: adv must be .* got adv \(3,\) for logp \(5,\)"):
        s2t_candidates(torch.zeros(5), adv, torch.ones(5, dtype=torch.bool))  # packed tokens, per-row adv
    assert s2t_candidates(torch.zeros(5), torch.ones(5), torch.ones(5, dtype=torch.bool)).shape == (5,)
    with pytest.raises(ValueError, match=r"num_tokens must be a 0-dim tensor, got shape \(1,\)"):
        stapo_loss(logp, logp, adv, valid, torch.tensor([12.0]))
