"""rollout.HFEngine's sleep: on CUDA it gives the accelerator memory back (weights to host memory, torch's
cache emptied), so a judge's process or the trainer can have it, and the next call brings the weights back
unchanged; on the CPU it does nothing. Checked on the CPU: the engine is told it is a CUDA one for its sleep
alone."""
import torch

import rollout

PROMPTS = [[5, 6, 7], [8, 9]]


def engine_of(tiny):
    d, tok = tiny
    return rollout.HFEngine(str(d / "model"), torch.device("cpu"), torch.float32, tok.eos_token_id)


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
