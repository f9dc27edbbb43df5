"""The policy's passes: its forward against the model's own log_softmax, the micro-batch cut and its
idle micro-batches, no host read inside the loops, the refused heads, the export, the memory peaks."""
import json
import math
import sys
import types

import pytest
import torch

import layers
import metrics
import parallel
import policy as policies
import stapo
from support import args_for, one_step_on_four_prompts, HostReads


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_policys_forward_is_the_models_log_softmax(tiny, attention):
    """policy.response_logprobs of right-padded samples of unequal lengths equals log_softmax of the model's
    own logits (transformers' forward, one sample at a time, unpadded) at each response token, zero after it:
    with sdpa the masks are handed over as None (the kernel masks causally), with eager attention transformers
    builds them. Breaks if a pad or a later token reaches a real one (a mask dropped where the kernel does not
    mask causally) or if a gather's index is off by one."""
    from transformers import AutoModelForCausalLM
    d, tok = tiny
    lm = AutoModelForCausalLM.from_pretrained(str(d / "model"), attn_implementation=attention)
    policy = policies.Policy(lm, layers.run_through(lm))
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(100, (p,), generator=g).tolist(), torch.randint(100, (r,), generator=g).tolist())
            for p, r in ((3, 4), (5, 1), (2, 7), (4, 0))]
    valid = torch.arange(9) < torch.tensor([len(r) for _, r in rows])[:, None]
    with torch.no_grad():
        got = policies.response_logprobs(policy, rows, [1, 3, 0, 2], valid, 1.0)
        for k, i in enumerate([1, 3, 0, 2]):
            prompt, response = rows[i]
            logits = lm(input_ids=torch.tensor([prompt + response])).logits[0].log_softmax(-1)
            want = logits[len(prompt) - 1:-1].gather(-1, torch.tensor(response, dtype=torch.long)[:, None])[:, 0]
            assert torch.allclose(got.logp[k, :len(response)], want, atol=1e-5), (attention, i)
            assert not got.logp[k, len(response):].any() and not got.entropy[k, len(response):].any()
    assert (policy.masks is None) == (attention == "eager")


def test_the_micro_batch_loops_never_wait_on_the_device(tiny, tmp_path, monkeypatch):
    """Inside the micro-batch loops of token_stats and update (the decoder, the head, the loss, the backward),
    no aten call needs a value on the host, so on a GPU the host queues the next micro-batch while the device
    runs this one. Only what runs once per mini-batch may read: the micro-batch count's all-reduce, and after
    the loop the statistics, the norms and the step. Breaks with the boolean-mask gathers of the former
    Policy.forward, its masked_scatter, or the head's backward indexing rows by a mask."""
    args, policy, opt, device, data, prompts, ids = one_step_on_four_prompts(tiny, tmp_path, "--micro-tokens", "80")
    rows = [(p, ids(f"\\boxed{{{a}}}" + " 1" * j)) for _, p, a in prompts for j in range(2)]
    idx = sorted(range(len(rows)), key=lambda i: len(rows[i][0]) + len(rows[i][1]))
    lengths = torch.tensor([len(r) for _, r in rows])
    valid = torch.arange(int(lengths.max())) < lengths[:, None]
    reads = HostReads()
    for module in (stapo, policies):
        monkeypatch.setattr(module, "micro_batches", reads.off_during(policies.micro_batches))
    tally = metrics.StepMetrics(0, "stapo")
    tally.loss_stats = reads.off_after(tally.loss_stats)  # after the loop: the statistics, norms, step
    assert len([m for m in policies.micro_batches(rows, idx, 80) if not m.idle]) >= 3  # several micro-batches
    keep = valid[idx].float()
    num_tokens = float(keep.sum())  # stapo.py's: a number all-reduced before the loop
    with reads:
        old = stapo.token_stats(policy, rows, idx, valid, args.micro_tokens, args.temperature)
        mb = stapo.MiniBatch(idx, old.logp, torch.linspace(-1, 1, len(idx)), keep, num_tokens)
        norm, _ = stapo.update(policy, opt, rows, valid, mb, args, tally)
    assert reads.seen == [] and norm > 0


def test_micro_batches_are_cut_where_the_fewest_tokens_are_computed():
    """policy.cut_by_length against every way to cut short sorted lists into micro-batches, each within the
    budget (or one sample alone), in order: the tokens computed (each padded to its longest) plus a cost per
    micro-batch are the least there is, at the trainer's cost and at others; at a cost that outweighs any
    padding, that is the fewest micro-batches that fit. A micro-batch padded to its shortest, a cut one sample
    late or early, or the greedy cut (the fewest, each as long as fits) in its place fails it."""
    import itertools
    import random
    rng = random.Random(0)
    for _ in range(400):
        n = sorted(rng.choice([rng.randint(1, 40), rng.randint(1, 8)]) for _ in range(rng.randint(1, 9)))
        budget, cost = rng.randint(8, 80), rng.choice([policies.MICRO_BATCH_COST, 0.0, 0.5, 1e6])
        scored = []
        for cuts in itertools.product((0, 1), repeat=len(n) - 1):
            bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [len(n)]
            parts = list(zip(bounds, bounds[1:]))
            if all(e - s == 1 or (e - s) * n[e - 1] <= budget for s, e in parts):
                scored.append((len(parts), sum((e - s) * n[e - 1] for s, e in parts) + cost * budget * len(parts)))
        got = policies.cut_by_length(n, budget, cost)
        assert [i for part in got for i in range(len(n))[part]] == list(range(len(n))), (n, got)
        assert all(p.stop - p.start == 1 or (p.stop - p.start) * n[p.stop - 1] <= budget for p in got), (n, got)
        total = sum(len(n[p]) * n[p.stop - 1] + cost * budget for p in got)
        assert math.isclose(total, min(x[1] for x in scored)), (n, budget, cost, got)
        if cost == 1e6:
            assert len(got) == min(x[0] for x in scored), (n, budget, got)
    assert policies.cut_by_length([], 10) == []
    assert policies.cut_by_length([50, 60], 10) == [slice(0, 1), slice(1, 2)]


def test_a_rank_with_fewer_micro_batches_runs_idle_ones(monkeypatch):
    """Every rank runs as many micro-batches as the rank with the most (FSDP's collectives meet in each): the
    others come idle, the mini-batch's first sample at weight 0. Breaks if the count is this rank's own, or
    an idle micro-batch is not marked so (its sample would be trained on twice)."""
    monkeypatch.setattr(policies, "all_reduce_numbers", lambda n, op: [5.0])  # another rank cuts 5
    rows = [([1] * 4, [2] * k) for k in (2, 3, 3, 9)]
    got = policies.micro_batches(rows, [0, 1, 2, 3], 24)
    assert got[:2] == [(slice(0, 3), False), (slice(3, 4), False)]  # 3 samples padded to 7, then 13 alone
    assert got[2:] == [(slice(0, 1), True)] * 3


def test_a_model_whose_logits_policy_would_get_wrong_is_refused(tmp_path):
    """Gemma-2 soft-caps its logits: Policy's hidden @ lm_head.weight would silently give wrong log-probs."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16)
    Gemma2ForCausalLM(cfg).save_pretrained(tmp_path / "gemma2")
    _, _, device, mesh = parallel.init_distributed()
    with pytest.raises(ValueError, match=r"gemma2: its logits are not hidden @ lm_head.weight "
                                         r"\(final_logit_softcapping=30.0\)"):
        stapo.build_policy(str(tmp_path / "gemma2"), mesh, device)


def test_the_hf_export_keeps_the_checkpoint_dtype(tiny, tmp_path):
    """Trained in fp32, exported in the dtype the starting checkpoint declares (Qwen3 ships bf16)."""
    from transformers import AutoModelForCausalLM
    d, _ = tiny
    AutoModelForCausalLM.from_pretrained(d / "model", dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / "bf16" / f).write_bytes((d / "model" / f).read_bytes())
    stapo.train(stapo.get_args(args_for(d, tmp_path / "run", "--model", str(tmp_path / "bf16"), "--steps", "1")))
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")
    assert json.load(open(tmp_path / "run" / "model" / "config.json"))["dtype"] == "bfloat16"
    assert out.lm_head.weight.dtype == torch.bfloat16


def test_memory_peak_on_cuda_leaves_out_what_torch_allocated_in_vllms_pool(monkeypatch):
    """On a GPU, vLLM's sleep mode allocates through torch's allocator in a pool of its own (CuMemAllocator,
    whose pointer_to_data is keyed by each segment's address), so torch's peak counts vLLM's weights and KV
    cache in every phase; peak_gb/* is the trainer's own. The segments outside that pool still count."""
    import types
    import metrics
    gib = 2**30
    segments = [{"address": 1000, "allocated_size": 40 * gib},  # vLLM's weights and KV cache, asleep or not
                {"address": 2000, "allocated_size": 3 * gib},   # the trainer's
                {"address": 3000, "allocated_size": 2 * gib}]   # vLLM's too
    allocator = types.SimpleNamespace(pointer_to_data={1000: object(), 3000: object()})
    cumem = types.SimpleNamespace(CuMemAllocator=types.SimpleNamespace(instance=allocator))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 50 * gib)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", cumem)
    assert metrics.memory_peak() == 8.0
    monkeypatch.delitem(sys.modules, "vllm.device_allocator.cumem")  # no engine with sleep mode: all counts
    assert metrics.memory_peak() == 50.0
