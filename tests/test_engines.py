"""rollout.HFEngine's sleep: on CUDA it gives the accelerator memory back (torch's cache emptied), so a judge's
process or the trainer can have it. For eval.py the weights wait in host memory and the next call brings them
back unchanged; in training they are dropped, and the next weight sync makes them anew, with no round trip
through host memory. On the CPU it does nothing. Checked on the CPU: the engine is told it is a CUDA one for
its sleep alone. And the weight sync's proof (rollout.push_weights: a digest of the weights pushed against the
engine's), its digest's properties and the HF engine's verdicts."""
import pytest
import torch

import rollout

PROMPTS = [[5, 6, 7], [8, 9]]


def engine_of(tiny, for_training=False):
    d, tok = tiny
    return rollout.HFEngine(str(d / "model"), torch.device("cpu"), torch.float32, tok.eos_token_id, for_training)


def tokens(engine):
    groups = engine.generate(PROMPTS, 2, 1.0, 1.0, 6, [11, 12])
    return [[s.tokens for s in group] for group in groups]


def sleep_as_on_cuda(engine, monkeypatch):
    """engine.sleep() as a CUDA engine runs it; what torch.cuda.empty_cache saw: the weights gone then?"""
    seen = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: seen.append(engine.parked is not None))
    engine.device = torch.device("cuda")
    try:
        engine.sleep()
    finally:
        engine.device = torch.device("cpu")  # where the weights come back to, here
    return seen


def test_sleep_on_cuda_releases_the_weights_and_the_next_call_restores_them(tiny, monkeypatch):
    """stapo.py's order (generate, sleep, load_weights, logprobs_of) and eval.py's (generate, sleep, then a
    judge in another process): asleep, the engine holds no weight on its device, and torch's cache is emptied
    after they left; generate, load_weights and logprobs_of each wake it, with the same numbers as an engine
    that never slept. Breaks with a sleep that does nothing (eval.py --engine hf --judge would keep the
    policy on the GPU beside its judge)."""
    awake, engine = engine_of(tiny), engine_of(tiny)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    assert sleep_as_on_cuda(engine, monkeypatch) == [True]
    assert all(p.numel() == 0 for p in engine.model.parameters())  # nothing of the weights left on the device
    assert tokens(engine) == tokens(awake)  # generate woke it, bit for bit
    assert all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())

    sleep_as_on_cuda(engine, monkeypatch)
    assert engine.logprobs_of([5, 6, 7, 8]) == awake.logprobs_of([5, 6, 7, 8])

    g = torch.Generator().manual_seed(0)
    new = [(n, p.detach() + 0.01 * torch.randn(p.shape, generator=g))
           for n, p in awake.model.named_parameters(remove_duplicate=False)]
    sleep_as_on_cuda(engine, monkeypatch)
    engine.load_weights(iter(new))  # the trainer's sync, on a sleeping engine
    awake.load_weights(iter(new))
    assert engine.parked is None and tokens(engine) == tokens(awake)
    assert engine.logprobs_of([5, 6, 7, 8]) == awake.logprobs_of([5, 6, 7, 8])


def test_sleep_on_the_cpu_moves_nothing(tiny, monkeypatch):
    """On the CPU sleep leaves every weight where it is (the trainer's runs compare key by key), and asks
    nothing of CUDA."""
    engine = engine_of(tiny)
    def empty_cache():
        raise AssertionError("torch.cuda.empty_cache on the CPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    where = [p.data_ptr() for p in engine.model.parameters()]
    engine.sleep()
    assert engine.parked is None and [p.data_ptr() for p in engine.model.parameters()] == where


def test_in_training_sleep_on_cuda_drops_the_weights_and_the_sync_makes_them_anew(tiny, monkeypatch):
    """stapo.py's engine (make_engine's, for training) asleep on CUDA: no weight left on the device and none
    copied to host memory (every step's sync rewrites them all); the sync makes each anew from what it pushes,
    after which the engine samples and scores as one that never slept, synced alike. Woken with no sync, it
    says so. Breaks with a sleep that copies the model to host memory and back every step."""
    d, tok = tiny
    engine = rollout.make_engine("hf", str(d / "model"), tok, torch.device("cpu"), 64, 0.5, for_training=True)
    awake = engine_of(tiny)
    assert engine.for_training and not engine_of(tiny).for_training  # eval.py's engines keep theirs
    assert sleep_as_on_cuda(engine, monkeypatch) == [True]
    assert engine.parked == {} and all(p.numel() == 0 for p in engine.model.parameters())  # nothing kept
    with pytest.raises(RuntimeError, match="dropped at its sleep, for training; a weight sync"):
        engine.generate(PROMPTS, 2, 1.0, 1.0, 6, [11, 12])
    g = torch.Generator().manual_seed(0)
    new = [(n, p.detach() + 0.01 * torch.randn(p.shape, generator=g))
           for n, p in awake.model.named_parameters(remove_duplicate=False)]
    engine.load_weights(iter(new))
    awake.load_weights(iter(new))
    assert engine.parked is None and tokens(engine) == tokens(awake)
    assert engine.logprobs_of([5, 6, 7, 8]) == awake.logprobs_of([5, 6, 7, 8])
    sleep_as_on_cuda(engine, monkeypatch)
    with pytest.raises(RuntimeError, match="left 1 weights unset"):  # a sync that misses a weight
        engine.load_weights(iter(new[1:]))


# ---- the sync's proof: the weight digest (rollout.push_weights) -----------------------------------------

def digest(tensor, dtype=torch.bfloat16, name="model.layers.0.mlp.up_proj.weight"):
    return rollout.digest_of([(name, tensor)], dtype)[rollout.digest_group(name)]


def nudged(t, at, ulps):
    """t with the value at flat index `at` moved by `ulps` units in the last place (its bit pattern's)."""
    t = t.clone()
    t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).view(-1)[at] += ulps
    return t


def test_the_digest_is_exact_and_blind_to_fusion_and_layout():
    """A part's digest is the same however vLLM holds its weights: q, k and v apart or fused into one qkv_proj
    (concatenated), a weight or its transpose (a packed copy read back), a bf16 value counted in bf16 or in fp32
    (the bf16 table and the hash it tabulates agree), -0 as +0 (a read-back product gives +0); and any changed
    value changes it: one ulp, and also one ulp up here and one down there (in the same binade, of the same sign),
    which a sum of bit patterns would cancel. Breaks if the digest summed bit patterns (the two ulps cancel),
    tabulated bf16 apart from the fp32 hash, or told -0 from +0."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (0.02 * torch.randn(n, 64, generator=g) for n in (64, 32, 32))
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        assert digest(torch.cat([q, k, v]), dtype) == digest(q, dtype) + digest(k, dtype) + digest(v, dtype)
        assert digest(q.t(), dtype) == digest(q, dtype) == digest(q.float(), torch.float32)
        zeros = torch.zeros(8, dtype=dtype)
        assert digest(zeros, dtype) == digest(-zeros, dtype) == 0
        assert digest(nudged(q, 5, 1), dtype) != digest(q, dtype)
        flat = q.reshape(-1).float()
        twin = next(i for i in range(1, flat.numel()) if flat[i].sign() == flat[0].sign()
                    and torch.frexp(flat[i]).exponent == torch.frexp(flat[0]).exponent)
        assert digest(nudged(nudged(q, 0, 1), twin, -1), dtype) != digest(q, dtype)


def test_the_digests_parts_are_the_same_on_hf_and_vllm_names():
    """HF's names and vLLM's fall into the same parts: a decoder layer's whole (vLLM fuses q, k, v and gate, up
    inside it), the embedding, the final norm, the LM head. Breaks if a layer's index were dropped (every layer
    one part: a swap of two layers' weights unseen) or a fused name fell into a part of its own."""
    hf = ["model.layers.11.self_attn.q_proj.weight", "model.layers.11.mlp.gate_proj.weight",
          "model.layers.11.input_layernorm.weight"]
    vllm = ["model.layers.11.self_attn.qkv_proj.weight", "model.layers.11.mlp.gate_up_proj.weight"]
    assert {rollout.digest_group(n) for n in hf + vllm} == {"model.layers.11"}
    assert rollout.digest_group("model.layers.1.mlp.down_proj.weight") == "model.layers.1"
    assert [rollout.digest_group(n) for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")] == [
        "model.embed_tokens", "model.norm", "lm_head"]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("tied", [False, True])
def test_the_weight_digest_catches_every_broken_sync_on_the_hf_engine(tied, dtype, tiny, tmp_path):
    """rollout.push_weights into the HF engine, one engine through every case (vllm_engine_check.digest_cases, as
    on vLLM's CPU build in tests/test_vllm.py): an engine on weights of its own (randomised) with nothing sent, a
    push that never reads its tensors, one that stops before the final norm and the lm_head, and one optimizer
    step at lr 1e-6 that never reached the engine, each fail; good syncs an optimizer step apart pass, in bf16
    too. A lm_head left out of an untied model fails; of a tied one it passes, for the engine's head is its
    embedding (the digest reads what the engine computes with); once the engine's head is a tensor of its own,
    it fails. Breaks if the digest left the lm_head out (the partial push passes for it), compared only the parts
    pushed (the unread push passes), were taken of what the engine was sent rather than of its weights (a push
    that sends nothing names no part that differs), or gave a tied model's head the embedding's digest (the
    engine's own head passes)."""
    import parallel
    import vllm_engine_check
    from policy import build_optimizer, build_policy
    from problems import encode_prompt
    d, tok = tiny
    model = tied_copy(d / "model", tmp_path / "tied") if tied else str(d / "model")
    rank, world, device, mesh = parallel.init_distributed()
    policy = build_policy(model, mesh, device, rollout.DTYPES[dtype])
    engine = rollout.HFEngine(model, device, rollout.DTYPES[dtype], tok.eos_token_id, for_training=True)
    assert (engine.model.lm_head.weight is engine.model.model.embed_tokens.weight) == tied
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in engine.model.parameters():  # never the policy's
            p.copy_(0.02 * torch.randn(p.shape, generator=g))
    seen = vllm_engine_check.digest_cases(engine, policy, tok, encode_prompt(tok, "What is 1 + 1?"))
    vllm_engine_check.check_verdicts(seen, rollout.DTYPES[dtype], head_unsent_held=tied)
    assert seen["good_probe_gap"] <= 1e-4 or dtype == "bf16"
    if tied:  # the engine's head, a tensor of its own: left out, it stays stale
        head = engine.model.lm_head
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        vllm_engine_check.one_step(policy, build_optimizer(policy, 1e-6, 0.1), tok, 5)
        unsent = vllm_engine_check.verdict(engine, policy, lambda named: rollout.HFEngine.load_weights(
            engine, ((n, t) for n, t in named if n != "lm_head.weight")))
        assert vllm_engine_check.parts_named(unsent) == {"lm_head"}, unsent



def tied_copy(path, out):
    """The model at path with its LM head tied to its input embedding (the embedding's values), as Qwen3-0.6B to 4B."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(out)
    return str(out)
