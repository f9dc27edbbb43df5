"""rollout.HFEngine's sleep: on CUDA it gives the accelerator memory back (torch's cache emptied), so a judge's
process or the trainer can have it. For eval.py the weights wait in host memory and the next call brings them
back unchanged; in training they are dropped, and the next weight sync makes them anew, with no round trip
through host memory. On the CPU it does nothing. Checked on the CPU: the engine is told it is a CUDA one for
its sleep alone."""
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
    that never slept. Broke before: sleep did nothing, so eval.py --engine hf --judge kept the policy on the
    GPU."""
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
    says so. Breaks with the former sleep, which copied the model to host memory and back every step."""
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
