"""Drives rollout.VLLMEngine on vLLM's CPU build, in a plain process (no torchrun), and writes what it saw
as JSON. Run by tests/test_vllm.py in a subprocess: vLLM's CPU worker rebinds threads and memory for the
rest of the process that builds it.

    python tests/vllm_engine_check.py MODEL OUT.json synced    # dummy load, then the trainer's sync
    python tests/vllm_engine_check.py MODEL OUT.json loaded    # an engine that loaded MODEL normally,
                                                               # then closed during an error, its wake failing
    python tests/vllm_engine_check.py MODEL OUT.json digest bf16   # the weight digest's verdicts (digest_cases)
                                                                   # on one engine in bf16 (or fp32)

digest_cases also runs on the HF engine, in tests/test_engines.py.
"""
import contextlib
import json
import os
import re
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


def main(model, out, mode, dtype="fp32"):
    from transformers import AutoTokenizer
    rank, world, device, mesh = parallel.init_distributed()
    tok = AutoTokenizer.from_pretrained(model)
    dtype = rollout.DTYPES[dtype]
    engine = VLLMEngine(model, 128, 0.5, for_training=mode != "loaded", dtype=dtype)
    seen = {"rank_env": os.environ.get("RANK")}
    probe = encode_prompt(tok, "What is 1 + 1?")
    if mode == "loaded":
        seen["tokens"] = sample(engine, tok, PROMPTS, SEEDS)
        seen["close"] = close_during_an_error(engine)
        return json.dump(seen, open(out, "w"))
    policy = policies.build_policy(model, mesh, device, dtype)
    if mode == "digest":
        return json.dump(digest_cases(engine, policy, tok, probe), open(out, "w"))

    # the first sync replaces the dummy weights; the probe then matches the trainer to float precision
    seen["digest_fresh"] = fresh_cases(engine, policy)
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
    seen["digest"] = digest_cases(engine, policy, tok, probe, fresh=False)  # fp32, untied: the fourth corner
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


# ---- the weight digest (rollout.push_weights) ------------------------------------------------------------

def one_step(policy, opt, tok, k):
    """One optimizer step of the trainer's (AdamW at the paper's lr 1e-6, weight decay 0.1) on a real loss: the
    negative log-likelihood of four sums' boxed answers (batch k)."""
    rows = [(encode_prompt(tok, f"What is {a} + {k}?"),
             tok.encode(f"\\boxed{{{a + k}}}", add_special_tokens=False) + [tok.eos_token_id]) for a in range(4)]
    valid = torch.zeros(len(rows), max(len(r) for _, r in rows), dtype=torch.bool)
    for i, (_, r) in enumerate(rows):
        valid[i, :len(r)] = True
    logp = policies.response_logprobs(policy, rows, list(range(len(rows))), valid, 1.0).logp
    (-(logp * valid).sum() / valid.sum()).backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def verdict(engine, policy, push=None):
    """rollout.push_weights through `push` in place of engine.load_weights (None: the real one): the error it
    raised, or None (the weights the engine computes with are those pushed)."""
    if push is not None:
        engine.load_weights = push
    try:
        rollout.push_weights(engine, policy.lm)
        return None
    except RuntimeError as e:
        return str(e)
    finally:
        if push is not None:
            del engine.load_weights


def gathered_not_sent(named):  # every tensor gathered (a collective, and digested), none sent
    for _ in named:
        pass


def fresh_cases(engine, policy):
    """The digest's verdicts on an engine never synced (vLLM's dummy weights, or an HF engine's own): nothing
    sent, then all but the final norm and the lm_head."""
    real = engine.load_weights
    return {"dummy": verdict(engine, policy, gathered_not_sent),
            "partial": verdict(engine, policy, lambda named: real(list(named)[:-2]))}


def digest_cases(engine, policy, tok, probe, fresh=True):
    """The digest's verdict on each kind of sync, on one engine (its weights' dtype: engine.dtype) and the
    policy it serves; fresh: the engine has never been synced, and fresh_cases come first."""
    real = engine.load_weights
    opt = policies.build_optimizer(policy, 1e-6, 0.1)
    seen = fresh_cases(engine, policy) if fresh else {}
    seen["never_read"] = verdict(engine, policy, lambda named: None)  # the iterator never read
    gaps = []
    for k in range(4):  # good syncs, an optimizer step apart
        if k:
            one_step(policy, opt, tok, k)
        seen[f"good_{k}"] = verdict(engine, policy)
        gaps.append(max(abs(a - b) for a, b in zip(engine.logprobs_of(probe), stapo_logprobs(policy, probe))))
        policy.reshard()
    seen["good_probe_gap"] = max(gaps)
    one_step(policy, opt, tok, 4)  # one step the engine never sees
    seen["stale"] = verdict(engine, policy, gathered_not_sent)
    seen["head_unsent"] = verdict(engine, policy, lambda named: real((n, t) for n, t in named if n != "lm_head.weight"))
    seen["good_again"] = verdict(engine, policy)
    return seen


def parts_named(error, what="other weights than those pushed in "):
    """The parts of the model a push_weights error names after `what`."""
    return set(error.split(what, 1)[1].split(" (")[0].split(";")[0].split(", ")) if what in (error or "") else set()


def check_verdicts(seen, dtype, head_unsent_held):
    """digest_cases' verdicts (fresh_cases' among them) as they must be, on either engine. head_unsent_held: the
    engine computes with the pushed weights although the lm_head went under the embedding's name alone (an HF
    engine of a tied model: one tensor; vLLM's CPU build keeps a packed copy of the head, which it leaves stale)."""
    every = re.compile(r"\((\d+) of \1 parts\)")
    for case, says in (("dummy", "other weights than those pushed"), ("never_read", "nothing pushed for")):
        assert seen[case] and every.search(seen[case]) and says in seen[case], (case, seen[case])
    assert [seen[f"good_{k}"] for k in range(4)] == [None] * 4 and seen["good_again"] is None, seen
    assert seen["good_probe_gap"] <= stapo.SYNC_TOLERANCE[dtype][1]  # the probe's check passes too
    assert seen["stale"] and parts_named(seen["stale"]), seen["stale"]
    want = {"model.norm"} if head_unsent_held else {"model.norm", "lm_head"}
    assert parts_named(seen["partial"]) == want, seen["partial"]
    if head_unsent_held:
        assert seen["head_unsent"] is None, seen["head_unsent"]
    else:
        assert parts_named(seen["head_unsent"]) == {"lm_head"}, seen["head_unsent"]


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
