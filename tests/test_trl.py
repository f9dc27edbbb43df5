"""examples/trl_stapo.py (STAPO as a TRL 1.16.0 GRPOTrainer) against TRL's own dapo loss and its own
GRPOTrainer (the pinned TRL, requirements-dev.txt), against an independent S2T mask, two processes against
one, and gradient accumulation against none. Offline: a tiny
Qwen3 built here; TRL's sampling is replaced by a deterministic one (tests/trl_check.py) except in the
command-line test. fp32 and plain SGD, so a wrong gradient scale shows in the parameters."""
import json, math, os, subprocess, sys

import pytest
import torch

pytest.importorskip("trl", reason="TRL is not installed (pip install -r requirements-dev.txt)")
import trl_check  # noqa: E402
from support import host_reads  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl_stapo import STAPOTrainer  # noqa: E402

pytestmark = pytest.mark.slow  # the fast tier, pytest -m "not slow", leaves these out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAME = dict(rtol=1e-5, atol=1e-6)  # parameters ~0.1 moved by ~3e-2; float32 reordering leaves < 1e-7


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("trl"))
    trl_check.build(d)
    return d


@pytest.fixture(scope="module")
def reference(folder):
    """One process, no accumulation: the parameters after trl_check.STEPS steps."""
    return trl_check.params(trl_check.train(folder, os.path.join(folder, "ref")))


def assert_same_params(got, want, what, **tolerance):
    for k in want:
        torch.testing.assert_close(got[k], want[k], **(tolerance or SAME),
                                   msg=lambda m, k=k: f"{what}, {k}: {m}")


def one_batch(folder, **trainer_kw):
    """A STAPOTrainer and one generation batch of TRL's own making (rewards, advantages, masks): 4 prompts
    x G samples of 2 to 16 tokens."""
    data = [json.loads(line) for line in open(os.path.join(folder, "data.jsonl"))][:4]
    trainer = trl_check.trainer(folder, os.path.join(folder, "one"), trainer_kw=trainer_kw)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); _compute_loss reads it
    trainer.model.train()
    batch = trainer._generate_and_score_completions([row for row in data for _ in range(trl_check.G)])
    assert (batch["advantages"] > 0).any() and (batch["advantages"] < 0).any()
    return trainer, batch


def loss_and_grads(loss_fn, trainer, batch):
    trainer.model.zero_grad()
    loss = loss_fn(trainer, trainer.model, batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters()]


def test_the_statistics_are_read_once_per_log_not_per_micro_batch(folder):
    """The subclass keeps the loss's statistics, S2T's silenced fraction and tau_h as 0-dim tensors, and reads
    them all at once when TRL logs: the host reads of a micro-batch's loss are only those of TRL's own forward
    (transformers' causal mask) and of the gather of each process's candidate count, and log() writes each
    statistic's mean over the micro-batches since the last log. Breaks with a float(stats[...]) per
    micro-batch, as the example had."""
    trainer, batch = one_batch(folder, tau_p=0.5)
    _, forward = host_reads(trainer._logps_and_entropies, trainer.model, batch, data_sized=False)
    _, gather = host_reads(trainer._gather_cat, torch.ones(3), data_sized=False)
    kept = []
    for _ in range(3):
        _, reads = host_reads(STAPOTrainer._compute_loss, trainer, trainer.model, batch, data_sized=False)
        assert reads == forward + gather, (reads, forward, gather)
    stats = trainer._stapo_stats["train"]
    assert set(stats) == {"silenced_frac", "tau_h", "clip_low", "clip_high"}
    assert all(len(v) == 3 and all(isinstance(x, torch.Tensor) and x.dim() == 0 for x in v) for v in stats.values())
    kept = {k: torch.stack(v).mean().item() for k, v in stats.items()}
    trainer.log({})
    logged = trainer.state.log_history[-1]
    assert {k: logged[f"stapo/{k}"] for k in kept} == pytest.approx(kept) and not trainer._stapo_stats
    assert 0 < logged["stapo/silenced_frac"] < 1


def test_nothing_silenced_and_no_dual_clip_is_trls_dapo_loss(folder):
    """tau_p = 0, clip_c=None, max_log_ratio=inf: the subclass's loss and every parameter gradient equal
    TRL's loss_type="dapo" on the same batch: on policy, with clipping active (old log p + N(0, 0.3)), and
    at ratios up to e^9 (N(0, 3)). Observed bit-equal; the tolerance (a few float32 ulps) only allows
    another order of the same float32 operations. With the default clip_c=10 the large-ratio case differs,
    and equals TRL with delta=10 (the same cap on A < 0 tokens, as 10 >= 1 + epsilon_high)."""
    trainer, batch = one_batch(folder, tau_p=0.0, clip_c=None, max_log_ratio=math.inf)
    with torch.no_grad():
        logp, _ = trainer._logps_and_entropies(trainer.model, batch)
    g = torch.Generator().manual_seed(0)
    for noise in (None, 0.3, 3.0):
        if noise is not None:
            batch["old_per_token_logps"] = logp + torch.randn(logp.shape, generator=g) * noise
        trl, trl_grads = loss_and_grads(GRPOTrainer._compute_loss, trainer, batch)
        ours, our_grads = loss_and_grads(STAPOTrainer._compute_loss, trainer, batch)
        torch.testing.assert_close(ours, trl, rtol=1e-6, atol=0)
        for a, b in zip(our_grads, trl_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert any(gr.abs().max() > 1e-3 for gr in trl_grads)
    trainer.clip_c = 10.0
    capped, _ = loss_and_grads(STAPOTrainer._compute_loss, trainer, batch)
    assert capped < trl - 1.0  # e^9 ratios on A < 0 tokens: TRL's dapo has no dual clip
    trainer.args.delta = 10.0
    trl_delta, _ = loss_and_grads(GRPOTrainer._compute_loss, trainer, batch)
    torch.testing.assert_close(capped, trl_delta, rtol=1e-6, atol=0)


OFF = dict(tau_p=0.0, clip_c=None, max_log_ratio=math.inf)  # S2T silences nothing (p < 0), no dual clip, no clamp


def test_the_pinned_trl_is_the_one_installed():
    """The equality tests below hold for the TRL that requirements-dev.txt pins (the README names it)."""
    import trl
    pins = [x.split("==")[1].strip() for x in open(os.path.join(ROOT, "requirements-dev.txt"))
            if x.startswith("trl==")]
    assert pins == [trl.__version__] == ["1.16.0"]


def parent_and_child(folder, tmp_path, ga=1, **config_kw):
    """TRL's own GRPOTrainer with loss_type="dapo", and the subclass with S2T off: two trainers, two models
    loaded from folder, one GRPOConfig."""
    parent = trl_check.trainer(folder, str(tmp_path / "parent"), ga=ga, cls=GRPOTrainer, loss_type="dapo",
                               **config_kw)
    child = trl_check.trainer(folder, str(tmp_path / "child"), ga=ga, trainer_kw=OFF, loss_type="dapo",
                              **config_kw)
    assert type(parent).__mro__[1] is GRPOTrainer and isinstance(child, STAPOTrainer)
    return parent, child


def optimizer_step(trainer, rows, noise=None):
    """One optimizer step through TRL's own path: _prepare_inputs generates the generation batch `rows`,
    shuffles and splits it into steps_per_generation micro-batches (the subclass runs S2T over the step there),
    then each of the step's micro-batches gets _compute_loss and backward. noise: the old log-probs are the
    policy's plus N(0, noise), drawn from a fixed seed (the same in both trainers), so clipping is active.
    Returns (each micro-batch's loss, its valid tokens, {name: the step's gradient})."""
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = ga = trainer.args.gradient_accumulation_steps
    losses, counts = [], []
    for j in range(ga):
        torch.manual_seed(0)  # TRL shuffles the generation batch before it splits it
        inputs = trainer._prepare_inputs(rows)
        if noise is not None and j == 0:
            g = torch.Generator().manual_seed(1)
            for b in trainer._buffered_inputs:
                with torch.no_grad():
                    logp, _ = STAPOTrainer._logps_and_entropies(trainer, trainer.model, b)
                b["old_per_token_logps"] = logp + torch.randn(logp.shape, generator=g) * noise
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        losses.append(loss.detach())
        counts.append(int(inputs["completion_mask"].sum()))
        trainer._step += 1
    return losses, counts, {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("ga,config_kw", [(1, {}), (2, dict(epsilon=0.1, epsilon_high=0.5, temperature=0.7))])
def test_an_optimizer_step_equals_trls_own_grpo_trainer_with_dapo(folder, tmp_path, ga, config_kw):
    """Against the parent itself: TRL 1.16.0's GRPOTrainer(loss_type="dapo") and STAPOTrainer with S2T off
    (tau_p=0, clip_c=None, max_log_ratio=inf), separate trainers on one GRPOConfig, one optimizer step of TRL's
    own path on the same generation batch (4 prompts x G): every micro-batch's loss and every named parameter's
    gradient are equal, float32, on policy and off it (old log p + N(0, 0.3), N(0, 3): both clips and e^9
    ratios). ga = 2 also moves epsilon, epsilon_high and the temperature off their defaults: a subclass that
    dropped one of them, or divided a micro-batch by its own tokens instead of the step's (TRL divides by
    num_items_in_batch / W * ga / steps_per_generation), fails here (both were checked to)."""
    rows = [r for r in (json.loads(x) for x in open(os.path.join(folder, "data.jsonl")))
            for _ in range(trl_check.G)][:trl_check.PROMPTS_PER_STEP * trl_check.G]
    for noise in (None, 0.3, 3.0):
        parent, child = parent_and_child(folder, tmp_path, ga, **config_kw)
        want, counts, want_grads = optimizer_step(parent, rows, noise)
        got, _, got_grads = optimizer_step(child, rows, noise)
        assert len(counts) == ga and (ga == 1 or counts[0] != counts[1])  # micro-batches of unequal length
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
        assert want_grads.keys() == got_grads.keys() and len(want_grads) == len(list(parent.model.parameters()))
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
        assert max(grad.abs().max() for grad in want_grads.values()) > 1e-3


def test_where_trls_normaliser_differs_steps_per_generation_a_multiple(folder, tmp_path):
    """The one setting where the subclass is not TRL's dapo: steps_per_generation = 2 x the accumulation, so a
    generation batch feeds two optimizer steps. TRL divides each by num_items_in_batch x ga / steps_per_generation
    (the generation batch's mean tokens per step); the subclass by the step's own count, DAPO's token mean (and
    what S2T needs: its kept count). So each step's loss and gradient are TRL's times mean / own count, exactly."""
    rows = [r for r in (json.loads(x) for x in open(os.path.join(folder, "data.jsonl")))
            for _ in range(trl_check.G)][:2 * trl_check.PROMPTS_PER_STEP * trl_check.G]
    parent, child = parent_and_child(folder, tmp_path, steps_per_generation=2)
    for _ in range(2):
        (want,), (count,), want_grads = optimizer_step(parent, rows)
        (got,), _, got_grads = optimizer_step(child, rows)
        mean = sum(int(b["completion_mask"].sum()) for b in parent._buffered_inputs) / 2
        assert count != mean
        torch.testing.assert_close(got, want * mean / count, rtol=1e-5, atol=0)
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad * mean / count, rtol=1e-5, atol=1e-7)


def test_silenced_tokens_get_zero_gradient_and_the_loss_is_renormalised(folder):
    """The defaults (tau_p=0.002, q=0.75) on a model with many candidates. The silenced set equals an
    independent one (torch.quantile in float64); d loss / d log p is exactly 0 there and at padding, and
    -A / kept at every kept token (on policy); the loss is the mean over kept tokens; and the parameter
    gradients equal TRL's own dapo loss with the silenced tokens dropped from its mask (tool_mask) and
    from its count (num_items_in_batch)."""
    trainer, batch = one_batch(folder)
    graphs = []

    def logps_and_entropies(model, b):  # keep the loss's own log p to read its gradient
        logp, entropy = STAPOTrainer._logps_and_entropies(trainer, model, b)
        if logp.requires_grad:
            logp.retain_grad()
            graphs.append(logp)
        return logp, entropy

    trainer._logps_and_entropies = logps_and_entropies
    loss, grads = loss_and_grads(STAPOTrainer._compute_loss, trainer, batch)
    logp = graphs[-1]
    with torch.no_grad():
        _, entropy = STAPOTrainer._logps_and_entropies(trainer, trainer.model, batch)
    valid, adv = batch["completion_mask"].bool(), batch["advantages"][:, None].expand_as(logp)
    candidates = valid & (adv > 0) & (logp.detach().exp() < 0.002)
    silenced = candidates & (entropy.double() < torch.quantile(entropy[candidates].double(), 0.75))
    keep = valid & ~silenced
    kept = int(keep.sum())
    assert silenced.sum() >= 10 and kept < valid.sum()
    assert torch.equal(logp.grad[~keep], torch.zeros(int((~keep).sum())))
    torch.testing.assert_close(logp.grad[keep], -adv[keep] / kept, rtol=1e-6, atol=0)
    assert loss.item() == pytest.approx(-adv[keep].double().sum().item() / kept, rel=1e-6, abs=1e-6)
    batch.update(tool_mask=keep.int(), num_items_in_batch=torch.tensor(kept))
    _, trl_grads = loss_and_grads(GRPOTrainer._compute_loss, trainer, batch)
    for a, b in zip(grads, trl_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_two_processes_give_the_parameters_of_one(folder, reference, tmp_path):
    """torchrun, 2 CPU processes (gloo, accelerate's DDP), the same global batch: after 2 SGD steps the
    parameters equal one process's, without and with gradient accumulation 2. This needs both the global
    tau_h and num_tokens = global kept / W: kept not divided by W doubles every update, a per-rank tau_h
    silences other tokens (both were checked to fail this test, by 1e-2)."""
    out = tmp_path / "two.pt"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    os.path.join(ROOT, "tests", "trl_check.py"), folder, str(out), "1", "2"],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    two = torch.load(out)
    initial = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert max((reference[k] - initial[k]).abs().max() for k in reference) > 1e-2  # far above SAME
    for ga in (1, 2):
        assert_same_params(two[ga], reference, f"2 processes, GA {ga}")


def test_gradient_accumulation_gives_the_parameters_of_one_micro_batch(folder, reference):
    """One process, gradient_accumulation_steps=2 (S2T over both micro-batches before the first backward,
    one num_tokens for both) against 1, on the same data: the same parameters after 2 SGD steps. S2T per
    micro-batch (its own tau_h and count) was checked to fail this test."""
    accumulated = trl_check.params(trl_check.train(folder, os.path.join(folder, "ga2"), ga=2))
    assert_same_params(accumulated, reference, "GA 2")


def test_nothing_silenced_trains_as_trl_dapo_with_accumulation(folder):
    """tau_p = 0, clip_c=None, max_log_ratio=inf, gradient accumulation 2: 2 steps of the subclass give
    TRL's own GRPOTrainer's parameters (TRL's dapo normaliser and num_tokens count the same tokens)."""
    free = dict(tau_p=0.0, clip_c=None, max_log_ratio=math.inf)
    ours = trl_check.params(trl_check.train(folder, os.path.join(folder, "ours"), ga=2, trainer_kw=free))
    trl = trl_check.params(trl_check.train(folder, os.path.join(folder, "trl"), ga=2, cls=GRPOTrainer))
    assert_same_params(ours, trl, "vs TRL", rtol=1e-6, atol=1e-7)


def test_the_script_trains_a_step_from_the_command_line(folder, tmp_path, monkeypatch):
    """examples/trl_stapo.py's main: GRPOConfig's flags and its own, TRL's own sampling, the boxed reward."""
    import trl_stapo
    monkeypatch.setattr(sys, "argv", [
        "trl_stapo.py", "--model", folder, "--dataset", os.path.join(folder, "data.jsonl"),
        "--output_dir", str(tmp_path), "--max_steps", "1", "--per_device_train_batch_size", "8",
        "--num_generations", "4", "--max_completion_length", "8", "--epsilon_high", "0.28",
        "--clip_c", "inf", "--use_cpu", "--bf16", "False", "--report_to", "none", "--save_strategy", "no",
        "--disable_tqdm", "True"])
    trl_stapo.main()
    assert (tmp_path / "model.safetensors").exists()


@pytest.mark.parametrize("setting", [dict(beta=0.04), dict(top_entropy_quantile=0.2), dict(loss_type="grpo"),
                                     dict(ga=2, steps_per_generation=3), dict(importance_sampling_level="sequence"),
                                     dict(delta=3.0), dict(off_policy_mask_threshold=0.5), dict(entropy_coef=0.01),
                                     dict(use_adaptive_entropy=True)])
def test_settings_it_cannot_honour_are_refused(folder, tmp_path, setting):
    """Each GRPOConfig option that TRL 1.16's _compute_loss applies to a dapo loss and stapo_loss has not is
    refused, not dropped (the options it honours, epsilon, epsilon_high and the temperature, are in the equality
    test above; vLLM's importance-sampling correction needs a vLLM server, and is refused by the same check)."""
    with pytest.raises(ValueError, match="STAPOTrainer cannot honour"):
        trl_check.trainer(folder, str(tmp_path), **setting)
