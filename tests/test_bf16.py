"""bf16 numerics on confident, trained-like distributions: the head (forward and backward, eager and compiled),
stapo_loss and S2T's candidates and tau_h, each against float64 of the same bf16-rounded inputs (the logits
rounded to bf16 as the model's head rounds them, tests/test_head.py's _reference) and beside a naive bf16
head on the same data: torch.log_softmax((h @ w.T).float() / T) with autograd, as a user's trainer computes it.

Every tolerance is the naive head's own error, times 2, or a stated bound where both sit at fp32's rounding.
Run with -s for the tables (docs/implementation.md has them):
    OMP_NUM_THREADS=1 python -m pytest tests/test_bf16.py -s -q -p no:cacheprovider
"""
import pytest
import torch

import head
import stapo_core
from test_head import _reference, _rel

T = 1.0
FLOOR = 1e-5  # fp32's rounding of values built from logits of ~20: 20 x 2^-24 x a few terms
TAU_P = 0.002  # the paper's


def aimed(m=512, d=64, v=4096, seed=0, rare=0.0):
    """bf16 (h [m, d], w [v, d]), tokens y and upstream gradients, at Qwen-like proportions but small. Each
    hidden state is aimed at its mode token u: h = noise + lift * w_u / |w_u|^2 lifts u's logit by
    lift ~ U(14, 22), so the sampled token's median p is about 0.998, 80% of them above 0.99 and 40% above
    0.999. A share `rare` of the positions samples another token instead, lifted gap ~ U(3, 10) nats less
    than u: their p mostly (90%) between 1e-5 and 0.1, with a median about S2T's tau_p = 0.002, among
    confident positions, as S2T's candidates are (rare = 0.3: median p 0.993, 55% above 0.99)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, d, generator=g) / d ** 0.5
    mode = torch.randint(v, (m,), generator=g)
    lift = 14 + 8 * torch.rand(m, generator=g)
    h = torch.randn(m, d, generator=g) + lift[:, None] * w[mode] / w[mode].norm(dim=1, keepdim=True) ** 2
    low = torch.rand(m, generator=g) < rare
    other = (mode + torch.randint(1, v, (m,), generator=g)) % v
    gap = 3 + 7 * torch.rand(m, generator=g)
    toward = (lift - gap)[:, None] * w[other] / w[other].norm(dim=1, keepdim=True) ** 2
    h = torch.where(low[:, None], h + toward, h)
    return h.bfloat16(), w.bfloat16(), torch.where(low, other, mode), torch.randn(m, generator=g)


def naive(h, w, y, coef):
    """log p, H, sum pi^2, grad_h, grad_w of the naive bf16 head: full logits, fp32 log_softmax, autograd."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    full = torch.log_softmax((h @ w.T).float() / T, -1)
    logp = full.gather(-1, y[:, None])[:, 0]
    (logp * coef).sum().backward()
    pi = full.detach().exp()
    return logp.detach(), -(pi * full.detach()).sum(-1), (pi ** 2).sum(-1), h.grad, w.grad


def chunked(h, w, y, coef):
    """The same five from head.ChunkedHead (collision on), eager or compiled as head.COMPILE says."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, entropy, sum_sq = head.ChunkedHead.apply(h, w, y, T, None, True)
    (logp * coef).sum().backward()
    return logp.detach(), entropy, sum_sq, h.grad, w.grad


def head_errors(got, ref, sure):
    """{quantity: error} of the head's five outputs against float64: the values' largest absolute error
    (nats), the gradients' relative error of the norm; grad_h also over the rows of `sure` (p_y > 0.99)."""
    err = {name: float((a.double() - b).abs().max())
           for name, a, b in zip(("log p", "H", "sum pi^2"), got[:3], ref[:3])}
    err["grad_h"], err["grad_w"] = _rel(got[3], ref[3]), _rel(got[4], ref[4])
    err["grad_h, p_y > 0.99"] = _rel(got[3][sure], ref[3][sure])
    return err


def table(title, columns, rows):
    """Print a table (pytest -s shows it): rows of (quantity, value per column)."""
    print(f"\n{title}\n| quantity | " + " | ".join(columns) + " |\n" + "|---" * (len(columns) + 1) + "|")
    for name, *values in rows:
        print(f"| {name} | " + " | ".join(v if isinstance(v, str) else f"{v:.2g}" for v in values) + " |")


def check_head(h, w, y, coef, label):
    """The head's five against float64 beside the naive head's, printed; each within its bound."""
    ref = _reference(h, w, y, coef, T)
    p = ref[0].exp()
    base, got = head_errors(naive(h, w, y, coef), ref, p > 0.99), head_errors(chunked(h, w, y, coef), ref, p > 0.99)
    bound = {k: max(2 * base[k], FLOOR) if k in ("log p", "H", "sum pi^2") else 2 * base[k] for k in base}
    table(f"{label}: median p_y {p.median():.4f}, {(p > 0.99).float().mean():.0%} > 0.99, "
          f"{(p > 0.999).float().mean():.0%} > 0.999, {(p < 0.01).sum()} below 0.01",
          ["naive bf16", "head", "bound"], [(k, base[k], got[k], bound[k]) for k in base])
    for k in base:
        assert got[k] <= bound[k], (k, got[k], base[k])


def test_the_fixture_is_confident():
    """The fixture is what the other tests need: median p_y >= 0.99 with a good share above 0.999, and its
    rare tokens straddle tau_p. Breaks if aimed() stops aiming (the head's bias needs p_y > 1 - 2^-9)."""
    h, w, y, _ = aimed()
    p = _reference(h, w, y, torch.zeros(len(y)), T)[0].exp()
    assert p.median() >= 0.99 and (p > 0.999).float().mean() >= 0.3
    h, w, y, _ = aimed(rare=0.3)
    p = _reference(h, w, y, torch.zeros(len(y)), T)[0].exp()
    assert (p < TAU_P).sum() >= 40 and ((p > TAU_P) & (p < 0.1)).sum() >= 40 and p.median() >= 0.99


@pytest.mark.parametrize("rare", [0.0, 0.3])
def test_the_eager_heads_bf16_values_and_gradients_are_as_close_to_float64_as_the_naive_heads(monkeypatch, rare):
    """The eager head (as a CPU runs it) in bf16: log p, H and sum pi^2 within 2x the naive head's error (or
    1e-5 nats), grad_h (all rows, and the rows with p_y > 0.99) and grad_w within 2x. Breaks if the sampled
    entry of slice_grad's (onehot - softmax) * scale is formed in bf16, as bf16(-p_y s) + s, which is 0 for
    p_y > 1 - 2^-9 (grad_h 0.22 off against naive's 0.0028; among rare tokens, whose gradients hide it in
    the whole norm, 0.77 on the confident rows), or if a pass of the forward rounds to bf16."""
    monkeypatch.setattr(head, "COMPILE", "0")
    check_head(*aimed(rare=rare), f"eager head, bf16, rare share {rare}")


@pytest.mark.slow
def test_the_compiled_heads_bf16_values_and_gradients_are_as_close_to_float64_as_the_naive_heads(monkeypatch):
    """As the eager test, with chunk_stats and slice_grad compiled by inductor (on CPU here; CUDA compiles the
    same graphs to Triton), on the confident fixture and the one with rare tokens. Breaks as the eager test
    does, for the compiled graphs: the sampled entry formed in bf16 fails it (grad_h 0.22 off). Compiling
    takes about half a minute here."""
    monkeypatch.setattr(head, "COMPILE", "1")
    monkeypatch.setattr(head, "_compiled", {})
    for rare in (0.0, 0.3):
        check_head(*aimed(rare=rare), f"compiled head, bf16, rare share {rare}")
    assert set(head._compiled) == {head.chunk_stats, head.slice_grad} and None not in head._compiled.values()


def formula(logp, old_logp, adv, eps_low=0.2, eps_high=0.28, clip_c=10.0):
    """stapo_loss's formula in its inputs' dtype, every token kept: the loss, clip_low, clip_high, the ratio."""
    ratio = (logp - old_logp).exp()
    per_token = torch.maximum(-ratio * adv, -ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    per_token = torch.where(adv < 0, torch.minimum(per_token, -clip_c * adv), per_token)
    return (per_token.mean(), ((adv < 0) & (ratio < 1 - eps_low)).double().mean(),
            ((adv > 0) & (ratio > 1 + eps_high)).double().mean(), ratio)


def test_stapo_loss_on_bf16_log_probs_is_as_close_to_float64_as_a_naive_loss_on_the_naive_heads(monkeypatch):
    """stapo_loss on the head's log-probs of a bf16 policy moved a little (h + N(0, 0.2^2), rounded: the
    ratios of tokens with p > 0.99 within 4e-3 of 1, the rare ones' from 0.54 to 2.1), beside the formula in
    fp32 on the naive head's: the ratio (exp(logp - old_logp), as stapo_loss forms it), the loss and its
    gradient in logp within 2x the naive error (or 1e-5, relative for the loss and the gradient), clip_low
    and clip_high exactly float64's (no ratio is within 1e-4 of a clip bound). The head's log-probs kept as
    bf16 tensors (TRL's selective_log_softmax returns them so for bf16 logits off its Triton kernel) are
    stated, and stapo_loss computes on them exactly as on their fp32 values. Breaks if the head's log-probs
    lose precision, or if stapo_loss computes in bf16 (its ratio in bf16: the loss 3e-4 off here, its
    gradient 4.5%, a token clipped that float64 does not clip)."""
    monkeypatch.setattr(head, "COMPILE", "0")
    h, w, y, coef = aimed(rare=0.3)
    g = torch.Generator().manual_seed(1)
    moved = (h.float() + 0.2 * torch.randn(h.shape, generator=g)).bfloat16()
    adv, keep = torch.randn(len(y), generator=g), torch.ones(len(y))
    logp64 = _reference(moved, w, y, coef, T)[0].requires_grad_()
    loss, low, high, ratio64 = formula(logp64, _reference(h, w, y, coef, T)[0], adv.double())
    loss.backward()
    ratio64 = ratio64.detach()
    assert ((ratio64 - 1).abs() > 0.2).sum() >= 20  # ratios reach the clip bounds
    assert ((ratio64 - 0.8).abs().min() > 1e-4) and ((ratio64 - 1.28).abs().min() > 1e-4)
    sources = {"naive bf16": lambda x: naive(x, w, y, coef)[0], "head": lambda x: chunked(x, w, y, coef)[0],
               "head, kept as bf16": lambda x: chunked(x, w, y, coef)[0].bfloat16()}
    err = {}
    for name, logprobs in sources.items():
        lp, old = logprobs(moved).requires_grad_(), logprobs(h)
        if name == "naive bf16":
            got, *clipped, _ = formula(lp, old, adv)
        else:
            got, stats = stapo_core.stapo_loss(lp, old, adv, keep)
            clipped = stats["clip_low"], stats["clip_high"]
        got.backward()
        err[name] = {"ratio (max abs)": float(((lp.detach().float() - old.float()).exp() - ratio64).abs().max()),
                     "clip_low (difference)": float(clipped[0] - low),
                     "clip_high (difference)": float(clipped[1] - high),
                     "loss (relative)": abs(float(got.detach() / loss.detach()) - 1),
                     "d loss / d logp (relative)": _rel(lp.grad, logp64.grad)}
        if name == "head, kept as bf16":  # upcast first: the same loss and gradient as on the widened values
            wide = lp.detach().float().requires_grad_()
            again, again_stats = stapo_core.stapo_loss(wide, old.float(), adv, keep)
            again.backward()
            assert torch.equal(got, again) and torch.equal(lp.grad, wide.grad.bfloat16())
            assert all(torch.equal(stats[k], again_stats[k]) for k in stats)
    table(f"stapo_loss on bf16 log-probs: {len(y)} tokens, clip_low {float(low):.4f}, clip_high {float(high):.4f}",
          list(err), [(k, *(err[n][k] for n in err)) for k in err["head"]])
    for k, value in err["head"].items():
        assert abs(value) <= (0 if "clip" in k else max(2 * abs(err["naive bf16"][k]), FLOOR)), (k, value)


def test_s2t_candidates_and_tau_h_from_bf16_log_probs_and_entropies(monkeypatch):
    """S2T at the paper's tau_p = 0.002 (q = 0.75) on 2,048 positions (163 candidates), from the bf16 head's
    log p and H through s2t_candidates and s2t_threshold, beside the naive head's through the formulas
    (torch.quantile in fp32). Against float64 of the same rounded logits the candidates are exactly float64's
    (no p is within 1e-4 of tau_p) and tau_h is within 2x the naive error (or 1e-5 nats). Against float64 of
    the unrounded logits (what bf16 logits cost any head: here 2 candidates, p within 3% of tau_p) the
    candidates that differ are exactly the naive ones, and tau_h is the naive one within 1e-5. Breaks if the
    head's log p or H lose precision where S2T reads them, or if s2t_threshold rounds (to bf16: 3.6e-4 off)."""
    monkeypatch.setattr(head, "COMPILE", "0")
    h, w, y, coef = aimed(m=2048, seed=1, rare=0.3)
    adv, valid = torch.randn(len(y), generator=torch.Generator().manual_seed(2)), torch.ones(len(y), dtype=torch.bool)
    naive_logp, naive_entropy = naive(h, w, y, coef)[:2]
    naive_c = valid & (adv > 0) & (naive_logp.exp() < TAU_P)
    logp, entropy = chunked(h, w, y, coef)[:2]
    got = stapo_core.s2t_candidates(logp, adv, valid, TAU_P)
    s2t = {"naive bf16": (naive_c, float(torch.quantile(naive_entropy[naive_c], 0.75))),
           "head": (got, float(stapo_core.s2t_threshold(entropy[got])))}
    rows, found = [], {}
    for exact, (logp64, entropy64) in (("rounded", _reference(h, w, y, coef, T)[:2]),
                                       ("unrounded", _reference(h.double(), w.double(), y, coef, T)[:2])):
        want = valid & (adv > 0) & (logp64.exp() < TAU_P)  # the paper's C and tau_h, in float64
        tau64 = float(torch.quantile(entropy64[want], 0.75))
        if exact == "rounded":
            assert ((logp64.exp() - TAU_P).abs() / TAU_P).min() > 1e-4
        for name, (candidates, tau) in s2t.items():
            differ = (candidates != want).nonzero()[:, 0]
            found[exact, name] = differ, tau - tau64
            near = float((logp64[differ].exp() / TAU_P - 1).abs().max()) if len(differ) else 0.0
            rows.append((f"against float64, {exact} logits: {name}", f"{len(differ)} of {int(want.sum())}",
                         near, tau - tau64, tau64))
    table(f"S2T at tau_p = 0.002 from bf16, {len(y)} positions",
          ["candidates that differ", "their p's largest distance from tau_p (relative)", "tau_h error (nats)",
           "float64 tau_h"], rows)
    assert len(found["rounded", "head"][0]) == 0
    assert abs(found["rounded", "head"][1]) <= max(2 * abs(found["rounded", "naive bf16"][1]), FLOOR)
    assert torch.equal(found["unrounded", "head"][0], found["unrounded", "naive bf16"][0])
    assert abs(found["unrounded", "head"][1] - found["unrounded", "naive bf16"][1]) <= FLOOR



def update_gradients(policy, rows, idx, valid, temperature, scale):
    """What stapo.update's micro-batch computes, in its own calls: the log p with the graph (policy's
    response_logprobs), stapo_loss over the tokens `scale` keeps with A = +-1 by row, the backward. Returns the
    log p and {parameter name: gradient}, in fp32."""
    from policy import response_logprobs
    policy.zero_grad(set_to_none=True)
    logp = response_logprobs(policy, rows, idx, valid, temperature).logp
    adv = torch.tensor([1.0 if i % 2 else -1.0 for i in idx])
    loss, _ = stapo_core.stapo_loss(logp, logp.detach(), adv, scale)
    loss.backward()
    return logp.detach(), {n[len("lm."):]: p.grad.full_tensor().float() for n, p in policy.named_parameters()}


def naive_update_gradients(path, rows, idx, valid, temperature, scale):
    """The same loss from a naive bf16 trainer: transformers' model in bf16, full logits, fp32 log_softmax,
    one unpadded sample at a time."""
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    logp = torch.zeros(valid.shape)
    for k, i in enumerate(idx):
        prompt, response = rows[i]
        logits = lm(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
        full = torch.log_softmax(logits.float() / temperature, -1)
        logp = logp.index_put((torch.tensor([k]), torch.arange(len(response))),
                              full.gather(-1, torch.tensor(response)[:, None])[:, 0])
    adv = torch.tensor([1.0 if i % 2 else -1.0 for i in idx])
    loss, _ = stapo_core.stapo_loss(logp, logp.detach(), adv, scale)
    loss.backward()
    return logp.detach(), {n: p.grad.float() for n, p in lm.named_parameters()}


@pytest.mark.slow
def test_the_compiled_bf16_update_is_as_close_to_fp32_as_a_naive_bf16_trainer(tiny):
    """The update's path in bf16 with the decoder layers compiled by inductor (what --compile-layers runs on a
    GPU; here its C++ backend), and eager, on confident tokens: the warm-started model's greedy answers read
    at temperature 0.5, the loss over the tokens with p > 0.999 (the sampled tokens' median p is above 0.99).
    Against the same path in fp32 (eager), the log p and the whole gradient are within twice a naive bf16
    trainer's error on the same tokens (transformers' bf16 model, full logits, fp32 log_softmax, the same
    loss). Breaks with the bf16 head's cancelling one-hot (slice_grad's sampled entry added after the cast to
    bf16: the push-up half of a confident token's gradient lost), or a compiled layer that loses precision
    eager keeps."""
    import parallel
    from policy import build_policy, shortest_first
    from rollout import HFEngine
    from problems import encode_prompt, load_problems
    d, tok = tiny
    path, temperature = str(d / "model"), 0.5
    prompts = [encode_prompt(tok, p) for p, _ in load_problems(str(d / "train.jsonl"))[:16]]
    engine = HFEngine(path, torch.device("cpu"), torch.float32, tok.eos_token_id)
    rows = [(p, o[0].tokens) for p, o in zip(prompts, engine.generate(prompts, 1, 0.0, 1.0, 8, [0] * 16))]
    idx = shortest_first(rows, range(len(rows)))
    valid = torch.arange(max(len(r) for _, r in rows)) < torch.tensor([len(r) for _, r in rows])[:, None]
    rank, world, device, mesh = parallel.init_distributed()
    torch._dynamo.reset()
    try:
        fp32 = build_policy(path, mesh, device, torch.float32)
        p = update_gradients(fp32, rows, idx, valid, temperature, valid[idx].float())[0].exp()
        assert p[valid[idx]].median() >= 0.99, p[valid[idx]].median()
        scale = (valid[idx] & (p > 0.999)).float()  # the confident tokens alone carry the loss
        assert scale.sum() >= 20, scale.sum()
        ref = update_gradients(fp32, rows, idx, valid, temperature, scale)
        runs = {"eager bf16": build_policy(path, mesh, device, torch.bfloat16),
                "compiled bf16": build_policy(path, mesh, device, torch.bfloat16, compiled=True)}
        got = {name: update_gradients(policy, rows, idx, valid, temperature, scale) for name, policy in runs.items()}
        assert runs["compiled bf16"].layers.compiled and runs["compiled bf16"].layers.eager_calls == 0
    finally:
        torch._dynamo.reset()
    got["naive bf16"] = naive_update_gradients(path, rows, idx, valid, temperature, scale)
    want = torch.cat([g.flatten() for g in ref[1].values()])

    def errors(logp, grads):
        flat = torch.cat([grads[n].flatten() for n in ref[1]])
        return float((logp - ref[0])[scale > 0].abs().max()), _rel(flat, want)
    table = {name: errors(*run) for name, run in got.items()}
    print(f"\nthe update's path in bf16 against fp32, on {int(scale.sum())} tokens of p > 0.999:")
    for name, (e_logp, e_grad) in table.items():
        print(f"  {name}: log p {e_logp:.2e} (largest), gradient {e_grad:.2e} (relative norm)")
    naive_logp, naive_grad = table["naive bf16"]
    for name in ("eager bf16", "compiled bf16"):
        assert table[name][0] <= 2 * naive_logp + FLOOR and table[name][1] <= 2 * naive_grad, (name, table)
