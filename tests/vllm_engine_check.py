"""Drives rollout.VLLMEngine on vLLM's CPU build, in a plain process (no torchrun), and writes what it saw
as JSON. Run by tests/test_vllm.py in a subprocess: vLLM's CPU worker rebinds threads and memory for the
rest of the process that builds it.

    python tests/vllm_engine_check.py MODEL OUT.json synced    # dummy load, then the trainer's sync
    python tests/vllm_engine_check.py MODEL OUT.json loaded    # an engine that loaded MODEL normally,
                                                               # then closed during an error, its wake failing
"""
import contextlib
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import rollout  # noqa: E402
import problems  # noqa: E402
import parallel  # noqa: E402
import policy as policies  # noqa: E402
import stapo  # noqa: E402
from problems import encode_prompt  # noqa: E402
from rollout import VLLMEngine  # noqa: E402

PROMPTS = ["What is 1 + 2?", "What is 7 + 5?"]
SEEDS = [problems.seed_of(0, 0, 0), problems.seed_of(0, 0, 1)]


def sample(engine, tok, prompts, seeds):
    groups = engine.generate([encode_prompt(tok, p) for p in prompts], 3, 1.0, 1.0, 8, seeds)
    return [[s.tokens for s in group] for group in groups]


def perturbed(policy, scale):
    """The policy's parameters plus seeded noise: a stand-in for trained weights."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(scale * torch.randn(local.shape, generator=g))


def main(model, out, mode):
    from transformers import AutoTokenizer
    rank, world, device, mesh = parallel.init_distributed()
    tok = AutoTokenizer.from_pretrained(model)
    engine = VLLMEngine(model, 128, 0.5, for_training=mode == "synced")
    seen = {"rank_env": os.environ.get("RANK")}
    probe = encode_prompt(tok, "What is 1 + 1?")
    if mode == "loaded":
        seen["tokens"] = sample(engine, tok, PROMPTS, SEEDS)
        seen["close"] = close_during_an_error(engine)
        return json.dump(seen, open(out, "w"))

    # the first sync replaces the dummy weights; the probe then matches the trainer to float precision
    policy = policies.build_policy(model, mesh, device)
    seen["dummy_probe_gap"] = max(abs(a - b) for a, b in zip(engine.logprobs_of(probe), stapo_logprobs(policy, probe)))
    seen["first_gap"] = stapo.sync_engine(engine, policy, probe, device)[1]
    seen["tokens"] = sample(engine, tok, PROMPTS, SEEDS)
    seen["alone"] = sample(engine, tok, PROMPTS[1:], SEEDS[1:])  # a request's samples ignore the batch

    # A -> B -> A: every sync is complete and exact
    perturbed(policy, 0.05)
    seen["b_gap"] = stapo.sync_engine(engine, policy, probe, device)[1]
    seen["tokens_b"] = sample(engine, tok, PROMPTS, SEEDS)
    perturbed(policy, -0.05)
    seen["back_gap"] = stapo.sync_engine(engine, policy, probe, device)[1]
    seen["tokens_again"] = sample(engine, tok, PROMPTS, SEEDS)

    # faulty syncs: the trainer moves on, the engine is left behind, and the self-check must say so
    perturbed(policy, 0.05)
    seen["caught"] = {}
    for name, push in faulty_pushes(engine).items():
        engine.load_weights = push
        try:
            stapo.sync_engine(engine, policy, probe, device)
            seen["caught"][name] = "not caught"
        except Exception as e:  # noqa: BLE001  (what it raised is the result)
            seen["caught"][name] = f"{type(e).__name__}: {e}"
        del engine.load_weights
    json.dump(seen, open(out, "w"))


def close_during_an_error(engine):
    """An error mid-step while the engine sleeps, and the wake at close runs out of memory (the CPU build has
    no sleep mode: the state and the failing wake are set by hand). What propagates, and whether vLLM's real
    shutdown ran: it detaches the engine core's finalizer and destroys the default process group."""
    core = engine.llm.llm_engine.engine_core
    engine.asleep = True

    def wake_up(tags=None):
        raise RuntimeError("CUDA Error: out of memory at cumem_allocator.cpp:128")
    engine.llm.wake_up = wake_up
    try:
        with contextlib.closing(engine):
            raise ValueError("an error mid-step")
    except Exception as e:  # noqa: BLE001  (what propagated is the result)
        raised = f"{type(e).__name__}: {e}", repr(e.__context__)
    return {"raised": raised[0], "context": raised[1], "engine_core_alive": core._finalizer.alive,
            "group_alive": torch.distributed.is_initialized(), "engine_dropped": engine.llm is None}


def stapo_logprobs(policy, probe):
    rows, valid = [(probe[:1], probe[1:])], torch.ones(1, len(probe) - 1, dtype=torch.bool)
    with torch.no_grad():
        return policies.response_logprobs(policy, rows, [0], valid, 1.0).logp[0].tolist()


def faulty_pushes(engine):
    real = engine.load_weights

    def stale(named):  # the weights are gathered (a collective), and never reach vLLM
        for _ in named:
            pass

    def partial(named):  # stops before the final norm and lm_head
        real(list(named)[:-2])

    def lm_head_via_model_load_weights(named):  # the previous sync, which the CPU build's repacking defeats
        named = list(named)
        real([(n, t) for n, t in named if n != "lm_head.weight"])
        engine.llm.apply_model(lambda model: model.load_weights([(n, t) for n, t in named if n == "lm_head.weight"]))

    return {"stale": stale, "partial": partial, "lm_head_via_model_load_weights": lm_head_via_model_load_weights}


if __name__ == "__main__":
    try:
        main(*sys.argv[1:])
    finally:  # a process group alive at exit can abort the process ("terminate called without an active exception")
        if torch.distributed.is_initialized():  # vLLM's shutdown destroys it
            torch.distributed.destroy_process_group()
