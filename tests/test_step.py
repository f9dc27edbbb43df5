"""One step of Algorithm 1 on the tiny model: the objectives on a fixed batch, S2T and the token analysis,
the metrics and logs a run writes, skipped and degenerate updates, rollout-IS, the warm-up."""
import json
import math
import sys
import types

import pytest
import torch

import analysis
import metrics
import parallel
import policy as policies
import problems
import stapo
from rollout import Sample
from support import PROBE, args_for, run, metrics_of, FixedEngine, one_step_on_four_prompts


def test_outputs_config_metrics_and_silenced_log(tiny, tmp_path, monkeypatch):
    """The run's files and keys; on every mini-batch of the run the taxonomy's spurious group is the set S2T
    silenced (breaks with another entropy cut than S2T's tau_h); the silenced tokens' applied share of the
    gradient is 0 and their share if kept is logged beside it (breaks with the unclipped, unsilenced weight)."""
    d, _ = tiny
    real_split, split = analysis.TokenAnalysis.split, []

    def checked(self, silenced, candidates, tau_h, entropy, low_p, adv, valid, tokens):
        if tau_h is not None:
            groups = analysis.token_groups(low_p, adv, entropy, valid, tau_h)
            split.append(torch.equal(groups[analysis.SPURIOUS], silenced))
        return real_split(self, silenced, candidates, tau_h, entropy, low_p, adv, valid, tokens)
    monkeypatch.setattr(analysis.TokenAnalysis, "split", checked)
    stapo.train(stapo.get_args(args_for(d, tmp_path, "--steps", "2", "--log-silenced", "--tau-p", "0.99",
                                        "--analysis")))
    assert split and all(split)
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["method"] == "stapo" and cfg["tau_p"] == 0.99 and cfg["world_size"] == 1
    m = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    need = {"reward_mean", "accuracy", "zero_variance_groups", "response_len_mean", "response_len_max", "truncated",
            "entropy_mean", "silenced_frac", "candidates", "tau_h", "clip_low", "clip_high", "grad_norm", "lr",
            "rollout_s", "train_s", "step_s", "tokens_per_s", "sync_probe_gap", "sync_probe_gap_mean",
            "taxonomy/split", "grad_share/silenced_if_kept", *[f"grad_share/{k}" for k in analysis.SHARES],
            *[f"taxonomy/{g}/{k}" for g in analysis.GROUPS for k in ("tokens", "grad_norm", "dH", "entropy")],
            "s2t_later/tokens", "s2t_later/logp_then", "s2t_later/logp_now", "s2t_later/rose",
            *[f"seconds/{phase}" for phase in ("rollout", "old_policy", "forward", "backward", "optimizer", "sync")]}
    assert need <= m[0].keys() and not any(k.startswith("rollout_is") for k in m[0])  # off by default
    # tau_p = 0.99 makes most tokens candidates, and S2T silences some on any CPU's kernels (at 0.9, none in
    # step 1 with ATEN_CPU_CAPABILITY=default)
    assert m[0]["silenced_frac"] > 0 and m[0]["candidates"] > 0
    for x in m:  # the token analysis: shares of the gradient, and of the split tokens, each summing to one
        assert sum(x[f"grad_share/{k}"] for k in analysis.SHARES) == pytest.approx(1)
        assert x["taxonomy/split"] > 0 and sum(x[f"taxonomy/{g}/tokens"] for g in analysis.GROUPS) == pytest.approx(1)
        assert x["grad_share/silenced"] == 0 and (x["grad_share/silenced_if_kept"] > 0) == (x["silenced_frac"] > 0)
        assert (x[f"taxonomy/{analysis.SPURIOUS}/tokens"] > 0) == (x["silenced_frac"] > 0)
    sil = [json.loads(x) for x in open(tmp_path / "silenced.jsonl")]
    assert {"step", "token", "t", "p", "H", "silenced", "left", "right"} == sil[0].keys()
    assert all(x["silenced"] for x in sil)  # under stapo; under the others S2T's set is logged, kept
    for step in (1, 2):  # one line per silenced token: silenced_frac * the step's 16 samples' valid tokens
        n_valid = m[step - 1]["response_len_mean"] * 16
        assert sum(x["step"] == step for x in sil) == round(m[step - 1]["silenced_frac"] * n_valid)
    assert all(x["p"] < 0.99 for x in sil)
    assert all(len(x["left"]) <= 40 and len(x["right"]) <= 40 for x in sil)


def test_s2t_set_is_revisited_at_its_context_a_few_steps_on(tiny, tmp_path):
    """--analysis keeps a sample of each step's S2T set and, analysis.Later's 5 steps on, reads its log p at the
    same context under the policy then: at lr 0 (the policy never moves) that is the log p it had, token for
    token within float noise, and under every objective (JustRL here). Breaks if the revisit reads another
    position than the token's (its context one token short or long), another row, or another step's sample."""
    d, _ = tiny
    stapo.train(stapo.get_args(args_for(d, tmp_path, "--steps", "7", "--tau-p", "0.99", "--analysis", "--lr", "0",
                                        "--method", "justrl")))
    m = metrics_of(tmp_path)
    assert [x["s2t_later/tokens"] for x in m[:5]] == [0] * 5 and all(x["s2t_later/tokens"] > 0 for x in m[5:])
    for x in m[5:]:
        assert x["s2t_later/logp_now"] == pytest.approx(x["s2t_later/logp_then"], abs=1e-5), x
        assert x["s2t_later/logp_then"] < math.log(0.99)


def test_report_to_sends_every_steps_numbers_and_is_imported_only_when_asked(tiny, tmp_path, monkeypatch):
    """--report-to wandb / tensorboard gets each step's numeric metrics at that step (what metrics.jsonl
    holds); without the flag neither package is imported, so a run never needs them."""
    d, _ = tiny
    sent, inits = [], []
    run = types.SimpleNamespace(log=lambda numbers, step: sent.append((step, numbers)))
    wandb = types.SimpleNamespace(init=lambda **kw: inits.append(kw) or run)

    class SummaryWriter:
        def __init__(self, path):
            self.path = path

        def add_scalar(self, key, value, step):
            if not sent or sent[-1][0] != step:
                sent.append((step, {}))
            sent[-1][1][key] = value

        def flush(self):
            pass
    tensorboard = types.SimpleNamespace(SummaryWriter=SummaryWriter)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tensorboard)
    for kind in ("wandb", "tensorboard"):
        sent.clear()
        stapo.train(stapo.get_args(args_for(d, tmp_path / kind, "--steps", "2", "--report-to", kind)))
        numbers = [(m["step"], {k: v for k, v in m.items() if isinstance(v, (int, float))})
                   for m in metrics_of(tmp_path / kind)]
        assert sent == numbers and len(sent) == 2 and "accuracy" in sent[0][1]
    # W&B: a project, the run named for --out; --resume continues the same W&B run (its id kept in --out)
    stapo.train(stapo.get_args(args_for(d, tmp_path / "wandb", "--steps", "3", "--report-to", "wandb",
                                        "--resume")))
    assert [kw["id"] for kw in inits] == [inits[0]["id"]] * 2 and inits[0]["name"] == "wandb"
    assert inits[0]["project"] and inits[1]["resume"] == "allow"
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it now raises ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    metrics.Reporter("none", str(tmp_path), {}).log({"step": 1, "accuracy": 0.5})
    for kind, package in (("wandb", "wandb"), ("tensorboard", "tensorboard")):  # one line, before any model
        with pytest.raises(parallel.UserError, match=f"--report-to {kind} needs the {package} package: pip install"):
            stapo.train(stapo.get_args(args_for(d, tmp_path / f"no_{kind}", "--report-to", kind)))
        assert not (tmp_path / f"no_{kind}").exists()


def test_degenerate_batches_give_finite_steps(tiny, tmp_path):
    tok = tiny[1]
    args, policy, opt, device, data, prompts, ids = one_step_on_four_prompts(tiny, tmp_path, "--method", "stapo")
    right, wrong = ids(f"\\boxed{{{data[0][1]}}}"), ids("\\boxed{99}")
    groups = [[Sample(right, "stop")] * 4,                                   # all correct: zero advantage
              [Sample(ids("\\boxed{98}"), "stop")] * 4,                      # all wrong: zero advantage
              [Sample([], "stop")] * 2 + [Sample(ids(f"\\boxed{{{data[2][1]}}}"), "stop")] * 2,  # empty
              [Sample(wrong[:3], "length")] * 3 + [Sample(ids(f"\\boxed{{{data[3][1]}}}"), "stop")]]  # truncated
    engine = FixedEngine(groups, args.model, tok)
    before = {k: v.full_tensor().clone() for k, v in policy.state_dict().items()}
    for method in ("stapo", "justrl", "grpo", "entropy20"):
        args.method = method
        metrics, _ = stapo.train_step(0, policy, opt, engine, tok, prompts, args, device, PROBE)
        assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), metrics
        assert metrics["zero_variance_groups"] == 0.5 and metrics["truncated"] == 3 / 16
        assert metrics["response_len_mean"] == sum(len(s.tokens) for g in groups for s in g) / 16
    assert engine.synced == len(list(policy.parameters())) * 4
    after = policy.state_dict()
    assert all(torch.isfinite(v.full_tensor()).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k].full_tensor()) for k in before)

    # all groups degenerate: zero advantages everywhere, a zero loss, and a step that does not crash
    engine.groups = [[Sample(right, "stop")] * 4] * 4
    metrics, _ = stapo.train_step(1, policy, opt, engine, tok, prompts, args, device, PROBE)
    assert metrics["zero_variance_groups"] == 1.0 and metrics["grad_norm"] == 0.0


def test_a_non_finite_gradient_skips_the_update(tiny, tmp_path, monkeypatch, capsys):
    """A batch whose loss is NaN (every gradient NaN, so the global norm is too): the optimizer does not step,
    every weight stays finite and equal to what it was, Adam's state stays empty, and the row says each update
    was skipped, with one line on stderr. The next step, its loss finite, trains. Breaks with opt.step() on a
    NaN norm (the clip multiplies every gradient by NaN; AdamW writes it into the weights)."""
    tok = tiny[1]
    args, policy, opt, device, data, prompts, ids = one_step_on_four_prompts(tiny, tmp_path, "--minibatches", "2")
    groups = [[Sample(ids(f"\\boxed{{{a}}}"), "stop")] * 2 + [Sample(ids("\\boxed{99}"), "stop")] * 2
              for _, _, a in prompts]  # half right in every group: every update has a signal
    engine = FixedEngine(groups, args.model, tok)
    real_loss = stapo.stapo_loss
    def nan_loss(*a, **k):
        loss, st = real_loss(*a, **k)
        return loss * math.nan, st
    monkeypatch.setattr(stapo, "stapo_loss", nan_loss)
    before = {k: v.full_tensor().clone() for k, v in policy.state_dict().items()}
    metrics, _ = stapo.train_step(0, policy, opt, engine, tok, prompts, args, device, PROBE)
    after = {k: v.full_tensor() for k, v in policy.state_dict().items()}
    assert all(torch.equal(before[k], after[k]) for k in before) and not opt.state
    assert metrics["skipped_updates"] == 2 and math.isnan(metrics["grad_norm"])
    assert capsys.readouterr().err.count("the gradient norm is nan; this update is skipped") == 2
    assert all(p.grad is None for p in policy.parameters())  # zeroed: nothing carries into the next update
    monkeypatch.setattr(stapo, "stapo_loss", real_loss)
    metrics, _ = stapo.train_step(1, policy, opt, engine, tok, prompts, args, device, PROBE)
    assert metrics["skipped_updates"] == 0 and metrics["grad_norm"] > 0
    after = {k: v.full_tensor() for k, v in policy.state_dict().items()}
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_method_objectives_on_a_fixed_batch(tiny):
    parallel.init_distributed()
    args = stapo.get_args(["--tau-p", "0.5", "--q", "0.5"])
    logp = torch.tensor([[0.1, 0.6, 0.3, 0.9], [0.2, 0.2, 0.2, 0.2], [0.1, 0.45, 0.9, 0.9]]).log()
    ent = torch.tensor([[0.5, 0.1, 2.0, 0.3], [0.4, 0.4, 0.4, 0.4], [1.0, 0.2, 3.0, 0.7]])
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 0.5])
    s2t = stapo.spurious_tokens(logp, ent, adv, valid, args.tau_p, args.q)
    # justrl: every valid token, one global count
    scale, num_tokens = stapo.token_scales("justrl", ent, valid, s2t)
    assert torch.equal(scale, valid) and num_tokens == 9
    # stapo: candidates (A > 0, p < 0.5, valid) are (0,0) H .5, (0,2) H 2, (2,0) H 1, (2,1) H .2;
    # median of [.2 .5 1 2] = .75, silenced: H < .75 -> (0,0), (2,1)
    scale, num_tokens = stapo.token_scales("stapo", ent, valid, s2t)
    silenced = torch.zeros_like(valid)
    silenced[0, 0] = silenced[2, 1] = True
    assert torch.equal(s2t.silenced, silenced) and torch.equal(scale, valid & ~silenced) and num_tokens == 7
    assert s2t.n_candidates == 4 and s2t.tau_h == pytest.approx(0.75)
    assert torch.equal(s2t.candidates.nonzero(), torch.tensor([[0, 0], [0, 2], [2, 0], [2, 1]]))
    # grpo: 1/|o_i| per token, the mean over sequences
    scale, num_tokens = stapo.token_scales("grpo", ent, valid, s2t)
    assert torch.allclose(scale, valid / torch.tensor([[3.0], [2.0], [4.0]])) and num_tokens == 3
    # entropy20: the top 20% entropy among the 9 valid tokens: 0.8-quantile of
    # the valid H = .5 .1 2 | .4 .4 | 1 .2 3 .7, sorted [.1 .2 .4 .4 .5 .7 1 2 3]: position 6.4 -> 1.4
    scale, num_tokens = stapo.token_scales("entropy20", ent, valid, s2t)
    expect = valid & (ent >= 1.4)
    assert torch.equal(scale, expect) and num_tokens == 2  # H = 2 and H = 3


def test_an_unchanged_policy_has_a_ratio_of_exactly_one_in_every_mini_batch(tiny, tmp_path, monkeypatch, one_thread):
    """At lr 0 the policy never moves, so every mini-batch's ratio must be exactly 1 in fp32: the old log-probs
    are computed in the micro-batches the update runs (the same padded shapes). Old log-probs of mini-batches
    1.. computed together, in other groupings, move the ratio by float noise (in bf16 by up to 0.05 nats)."""
    d, _ = tiny
    seen, passes = [], []
    real_loss, real_pass = stapo.stapo_loss, stapo.token_stats

    def recording(logp, old_logp, adv, keep, *a, **k):
        seen.append((logp.detach() - old_logp)[keep > 0])
        return real_loss(logp, old_logp, adv, keep, *a, **k)

    def token_stats(policy, rows, idx, *a, **k):
        passes.append(sorted(idx))
        return real_pass(policy, rows, idx, *a, **k)
    monkeypatch.setattr(stapo, "stapo_loss", recording)
    monkeypatch.setattr(stapo, "token_stats", token_stats)
    for micro in ("40", "4096"):  # several unequal micro-batches per mini-batch; one
        seen.clear()
        passes.clear()
        stapo.train(stapo.get_args(args_for(d, tmp_path / micro, "--steps", "1", "--lr", "0", "--minibatches", "4",
                                            "--prompts-per-step", "8", "--micro-tokens", micro)))
        assert len(seen) >= 4 and sum(x.numel() for x in seen) > 50
        assert all(torch.equal(x, torch.zeros_like(x)) for x in seen), [x.abs().max() for x in seen]
        blocks = [list(range(b * 8, b * 8 + 8)) for b in range(4)]  # 4 mini-batches of 2 prompts x 4 samples
        assert passes[:4] == blocks  # the old pass: mini-batch by mini-batch, each then micro-batched alone
        assert passes[4:] == blocks[1:]  # then the current policy's, after each update (none before the first)


def test_the_eight_groups_and_the_gradient_shares_by_hand(tiny):
    """Two rows of three tokens, A = +1 and -1, tau_p 0.5; S2T's candidates (0,0) H .2 and (0,2) H .9 give
    tau_h = .725, which splits H: each token lands in its group, (0,0) alone in the spurious group, the set
    S2T silences. Ratios of 1.5 at (0,1) (A > 0: clip-higher) and 0.5 at (1,0) (A < 0: the lower clip) zero
    those tokens' applied gradient; the silenced token's is zero too, and its share if kept is logged beside.
    Breaks with the median H as the entropy cut ((1,0), H .5, would be high-H), the unclipped weight in the
    shares, or the plain-gradient entropy change."""
    parallel.init_distributed()
    args = stapo.get_args(["--tau-p", "0.5"])
    p = torch.tensor([[0.1, 0.9, 0.2], [0.8, 0.3, 0.6]])
    ent = torch.tensor([[0.2, 0.1, 0.9], [0.5, 0.3, 0.4]])
    collision = torch.tensor([[0.8, 0.82, 0.3], [0.66, 0.4, 0.45]])  # each >= p^2
    ratio = torch.tensor([[1.0, 1.5, 1.0], [0.5, 1.0, 1.0]])
    adv, valid = torch.tensor([1.0, -1.0]), torch.ones(2, 3, dtype=torch.bool)
    old = p.log() - ratio.log()
    s2t = stapo.spurious_tokens(p.log(), ent, adv, valid, args.tau_p, args.q)
    assert s2t.silenced.nonzero().tolist() == [[0, 0]] and s2t.tau_h == pytest.approx(0.725)
    keep, ones = (valid & ~s2t.silenced).float(), valid.float()  # no --rollout-is: its weights are 1
    m = analysis.TokenAnalysis("stapo", stapo.clip_settings(args), args.tau_p, args.temperature)
    now, sums = policies.TokenStats(p.log(), ent, collision), dict.fromkeys(analysis.KEYS, 0.0)
    metrics.accumulate(sums, m.sums(now, old, adv, valid, keep, 5.0, s2t, ones))
    w = ratio * adv[:, None]  # the policy-gradient term's weight, ratio * A
    norm = w.abs() * (1 - 2 * p + collision).sqrt()  # T = 1
    change = -w * p * (p.log() + ent)
    groups = {"posA_lowP_lowH": [(0, 0)], "posA_highP_lowH": [(0, 1)], "posA_lowP_highH": [(0, 2)],
              "negA_highP_lowH": [(1, 0), (1, 2)], "negA_lowP_lowH": [(1, 1)]}
    for g in analysis.GROUPS:
        cells = groups.get(g, [])
        assert sums[f"{g}/n"] == len(cells), g
        assert sums[f"{g}/norm"] == pytest.approx(sum(norm[c].item() for c in cells)), g
        assert sums[f"{g}/dH"] == pytest.approx(sum(change[c].item() for c in cells)), g
    applied = (1 - 2 * p + collision).sqrt() / 5  # |A| r keep / n, where the term is live
    assert sums["g2/silenced"] == 0 and sums["g2/silenced_if_kept"] == pytest.approx(applied[0, 0].item() ** 2)
    assert sums["g2/candidates_kept"] == pytest.approx(applied[0, 2].item() ** 2)
    assert sums["g2/rest"] == pytest.approx(applied[1, 1].item() ** 2 + applied[1, 2].item() ** 2)
    row = analysis.shares_row(sums)
    assert row["grad_share/silenced"] == 0 and row["grad_share/rest"] + row["grad_share/candidates_kept"] == 1
    if_kept = sums["g2/silenced_if_kept"] / (sums["g2/silenced_if_kept"] + sums["g2/candidates_kept"] + sums["g2/rest"])
    assert row["grad_share/silenced_if_kept"] == pytest.approx(if_kept)
    assert sums["split"] == sums["nonzero"] == 6
    none = stapo.spurious_tokens(p.log(), ent, -adv.abs(), valid, args.tau_p, args.q)  # A < 0: no candidate, no tau_h
    metrics.accumulate(sums, m.sums(now, old, -adv.abs(), valid, valid.float(), 6.0, none, ones))
    assert none.tau_h is None and sums["split"] == 6 and sums["nonzero"] == 12
    assert sum(sums[f"{g}/n"] for g in analysis.GROUPS) == 6  # the mini-batch with no tau_h is in no group
    assert analysis.taxonomy_row(sums)["taxonomy/split"] == 0.5


def test_rollout_is_weights_the_loss_and_is_exact_when_the_sampler_agrees(tiny, tmp_path):
    """A sampler whose log-probs equal the trainer's (rho = 1): --rollout-is token leaves the update bit for bit
    what --rollout-is none gives. A sampler that reports log p = 0 (p = 1): rho = the trainer's p, logged
    as the ratio's min, mean and max, and the update moves differently."""
    d, tok = tiny
    rank, world, device, mesh = parallel.init_distributed()
    data = problems.load_problems(str(d / "train.jsonl"))[:4]
    prompts = [(i, problems.encode_prompt(tok, p), a) for i, (p, a) in enumerate(data)]
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # noqa: E731
    rows = [(p, ids(f"\\boxed{{{a}}}" if j < 2 else "\\boxed{99}")) for i, p, a in prompts for j in range(4)]
    valid = torch.ones(16, max(len(r) for _, r in rows), dtype=torch.bool)
    valid &= torch.arange(valid.shape[1]) < torch.tensor([len(r) for _, r in rows])[:, None]
    args = stapo.get_args(args_for(d, tmp_path, "--minibatches", "1", "--micro-tokens", "4096", "--warmup-steps", "0"))
    results = {}
    for mode, sampler in [("none", "trainer"), ("token", "trainer"), ("token", "zero")]:
        policy = stapo.build_policy(args.model, mesh, device)
        order = sorted(range(16), key=lambda i: len(rows[i][0]) + len(rows[i][1]))  # as split_minibatches
        trainer_logp = stapo.token_stats(policy, rows, order, valid, args.micro_tokens, args.temperature)
        logp = torch.zeros(valid.shape)
        logp[order] = trainer_logp.logp
        groups = [[Sample(rows[i * 4 + j][1], "stop", logp[i * 4 + j][valid[i * 4 + j]].tolist()
                          if sampler == "trainer" else [0.0] * len(rows[i * 4 + j][1])) for j in range(4)]
                  for i in range(4)]
        args.rollout_is = mode
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        metrics, _ = stapo.train_step(0, policy, opt, FixedEngine(groups, args.model, tok), tok, prompts, args,
                                      device, PROBE)
        results[(mode, sampler)] = metrics, {k: v.full_tensor().clone() for k, v in policy.state_dict().items()}
    none, same, zero = results[("none", "trainer")], results[("token", "trainer")], results[("token", "zero")]
    assert none[0]["reward_mean"] == 0.0 and none[0]["grad_norm"] > 0  # half right: the update is not empty
    assert all(torch.equal(none[1][k], same[1][k]) for k in none[1])
    assert same[0]["rollout_is_min"] == same[0]["rollout_is_max"] == 1.0
    p = logp[valid].exp()
    assert zero[0]["rollout_is_min"] == pytest.approx(p.min().item(), rel=1e-5)
    assert zero[0]["rollout_is_mean"] == pytest.approx(p.mean().item(), rel=1e-5)
    assert zero[0]["rollout_is_max"] == pytest.approx(p.max().item(), rel=1e-5)
    assert any(not torch.equal(none[1][k], zero[1][k]) for k in none[1])


def test_reward_dapo_trains_on_the_papers_reward(tiny, tmp_path):
    """--reward dapo scores the step's samples with DAPO's strict box (reward.dapo_score): a zero-padded
    `\\boxed{017}` for the gold 17 is right under the default equivalence checker and wrong under DAPO's string
    match. Per prompt: the exact box, the padded box, two wrong ones; accuracy 1/2 (equiv) against 1/4 (dapo).
    Breaks if the flag does not reach score_all (both give 1/2)."""
    d, tok = tiny
    rank, world, device, mesh = parallel.init_distributed()
    data = problems.load_problems(str(d / "train.jsonl"))[:4]
    prompts = [(i, problems.encode_prompt(tok, p), a) for i, (p, a) in enumerate(data)]
    assert all(a.isdigit() and a != "99" for _, _, a in prompts)
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # noqa: E731
    texts = ["\\boxed{%s}", "\\boxed{0%s}", "\\boxed{99}", "\\boxed{99}"]
    groups = [[Sample(ids(t % a if "%" in t else t), "stop") for t in texts] for _, _, a in prompts]
    accuracy = {}
    for reward in ("equiv", "dapo"):
        args = stapo.get_args(args_for(d, tmp_path, "--lr", "0", "--reward", reward))
        policy = stapo.build_policy(args.model, mesh, device)
        opt = torch.optim.AdamW(policy.parameters(), lr=0.0)
        row, _ = stapo.train_step(0, policy, opt, FixedEngine(groups, args.model, tok), tok, prompts, args,
                                  device, PROBE)
        accuracy[reward] = row["accuracy"]
    assert accuracy == {"equiv": 0.5, "dapo": 0.25}


def test_the_warm_up_is_verls_as_justrl_runs_it():
    """lr * t / W at RL step t < W, then lr (verl 0.4.0's get_constant_schedule_with_warmup, stepped once per RL
    step): 0 at step 0, 0.1 lr at step 1, 0.9 lr at step 9, lr from step 10; W = 0 is lr from the start. Breaks
    with a schedule one step ahead, (t + 1) / W."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    args = stapo.get_args(["--lr", "1e-6", "--warmup-steps", "10"])
    lrs = [stapo.set_lr(opt, args, t) for t in (0, 1, 9, 10, 500)]
    assert lrs == pytest.approx([0.0, 1e-7, 9e-7, 1e-6, 1e-6], abs=1e-15) and opt.param_groups[0]["lr"] == 1e-6
    assert stapo.set_lr(opt, stapo.get_args(["--lr", "1e-3", "--warmup-steps", "0"]), 0) == 1e-3


def test_the_lm_heads_gradient_norm_is_logged_per_update(tiny, tmp_path, monkeypatch):
    """lm_head_grad_norm holds one number per update (--minibatches of them), each the norm of the LM head's
    gradient before the update's clip, at most the whole model's norm in that update (grad_norm is their mean
    over the step). Breaks with the whole model's norm, a norm after the clip (clipped here to 1e-6), or one
    number per step."""
    d, _ = tiny
    heads, wholes, real_clip = [], [], torch.nn.utils.clip_grad_norm_

    def clip(params, max_norm):  # the head's gradient as the clip finds it, then a clip to 1e-6
        heads.append(float(stapo_policy[0].lm.get_output_embeddings().weight.grad.full_tensor().norm()))
        wholes.append(real_clip(params, 1e-6))
        return wholes[-1]
    stapo_policy, real_build = [], stapo.build_policy
    monkeypatch.setattr(stapo, "build_policy", lambda *a: stapo_policy.append(real_build(*a)) or stapo_policy[0])
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    stapo.train(stapo.get_args(args_for(d, tmp_path, "--steps", "2", "--minibatches", "2", "--warmup-steps", "0")))
    m = metrics_of(tmp_path)
    assert [len(x["lm_head_grad_norm"]) for x in m] == [2, 2]
    assert [v for x in m for v in x["lm_head_grad_norm"]] == pytest.approx(heads, rel=1e-6)
    assert max(heads) > 1e-4  # above the clip: a norm read after it would be 1e-6 at most
    assert all(w >= h for w, h in zip(map(float, wholes), heads))  # the head is part of the whole model
    # per update, not per step: an update whose gradient is 0 pulls the step's mean below
    # another update's head norm (seen with ATEN_CPU_CAPABILITY=default)
    assert [x["grad_norm"] for x in m] == pytest.approx([float(sum(wholes[:2])) / 2, float(sum(wholes[2:])) / 2])
