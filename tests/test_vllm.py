"""VLLMEngine against a fake vllm that records every call (vLLM cannot run without a GPU)."""
import importlib
import json
import os
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import rollout
import stapo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "tests", "fake_vllm"))
    sys.modules.pop("vllm", None)
    vllm = importlib.import_module("vllm")
    vllm.CALLS.clear()
    vllm.FAULTS["stale"] = False
    yield vllm
    sys.modules.pop("vllm", None)


def compress(calls):
    """The call sequence with each run of load_weights folded into one entry."""
    out = []
    for c in calls:
        if c[0] == "load_weights" and out and out[-1][0] == "load_weights":
            out[-1] = ("load_weights", out[-1][1] + 1)
        else:
            out.append(("load_weights", 1) if c[0] == "load_weights" else c[:2] if c[0] != "generate" else c[:1])
    return out


def args_for(d, out, *extra):
    return ["--model", str(d / "model"), "--dataset", str(d / "train.jsonl"), "--out", str(out), "--engine", "vllm",
            "--prompts-per-step", "4", "--group-size", "4", "--minibatches", "2", "--max-prompt-len", "64",
            "--max-response-len", "6", "--lr", "1e-3", "--gpu-memory-utilization", "0.55", *extra]


def test_protocol_every_step_and_after_resume(tiny, tmp_path, fake_vllm):
    d, tok = tiny
    stapo.train(stapo.get_args(args_for(d, tmp_path, "--steps", "2", "--save-every", "2")))
    llm_call = fake_vllm.CALLS[0]
    assert llm_call == ("LLM", {"model": str(d / "model"), "distributed_executor_backend": "external_launcher",
                                "tensor_parallel_size": 1, "seed": 0, "gpu_memory_utilization": 0.55,
                                "enable_sleep_mode": True, "max_model_len": 64 + 6,
                                "logprobs_mode": "processed_logprobs", "load_format": "dummy", "dtype": "bfloat16"})
    n_params = len(list(AutoModelForCausalLM.from_pretrained(d / "model").parameters()))
    sync = [("wake_up", ("weights",)), ("load_weights", n_params), ("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]
    step = [("generate",), ("sleep", 2)] + sync
    assert compress(fake_vllm.CALLS[1:]) == [("sleep", 2)] + sync + step * 2

    # generation requests: token-id prompts, the paper's sampling, one seed per prompt, no token past the vocab
    _, prompts, params = next(c for c in fake_vllm.CALLS if c[0] == "generate")
    assert len(prompts) == 4 and all(isinstance(t, int) for p in prompts for t in p)
    assert all(kw == {"n": 4, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 6, "logprobs": 0,
                      "seed": kw["seed"], "allowed_token_ids": list(range(len(tok)))} for kw in params)
    assert len({kw["seed"] for kw in params}) == 4

    # the last sync pushed exactly the trainer's final weights (as bf16), under HF names
    last = [c for c in fake_vllm.CALLS if c[0] == "load_weights"][-n_params:]
    final_model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    final = final_model.state_dict()
    assert [c[1] for c in last] == [k for k, _ in final_model.named_parameters()]
    for _, name, tensor in last:
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, final[name].to(torch.bfloat16)), name

    # the logged gap between the sampler's and the trainer's log-probs
    m = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert all(0 <= x["logprob_gap_mean"] <= x["logprob_gap_max"] < 0.5 for x in m)

    # after --resume: a fresh engine, synced before its first rollout
    fake_vllm.CALLS.clear()
    stapo.train(stapo.get_args(args_for(d, tmp_path, "--steps", "3", "--save-every", "2", "--resume")))
    assert compress(fake_vllm.CALLS[1:]) == [("sleep", 2)] + sync + step
    first_push = [c for c in fake_vllm.CALLS if c[0] == "load_weights"][:n_params]
    ckpt = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt" / "step_2" / "hf").state_dict()
    assert all(torch.equal(t, ckpt[n].to(torch.bfloat16)) for _, n, t in first_push)


def _engine(d, tok):
    return rollout.VLLMEngine(str(d / "model"), 0, tok, 70, 0.3)


def _trained_weights(d, scale=0.01):
    torch.manual_seed(1)
    m = AutoModelForCausalLM.from_pretrained(d / "model")
    return [(n, p.detach() + scale * torch.randn_like(p)) for n, p in m.named_parameters()]


def test_a_stale_sync_is_caught(tiny, fake_vllm):
    d, tok = tiny
    engine = _engine(d, tok)
    engine.load_weights(_trained_weights(d))  # a good sync passes its self-check
    fake_vllm.FAULTS["stale"] = True          # now vLLM keeps its old weights whatever it is sent
    with pytest.raises(RuntimeError, match="stale sync"):
        engine.load_weights(_trained_weights(d, scale=0.02))


def test_a_partial_sync_is_caught(tiny, fake_vllm):
    d, tok = tiny
    engine = _engine(d, tok)
    weights = _trained_weights(d)
    with pytest.raises(RuntimeError, match="partial sync"):
        engine.load_weights(weights[:-2])  # stops before the final norm and lm_head


def test_generate_returns_tokens_finish_reason_and_logprobs(tiny, fake_vllm):
    d, tok = tiny
    engine = _engine(d, tok)
    engine.load_weights(_trained_weights(d, 0.0))
    prompt = stapo.encode_prompt(tok, "What is 1 + 2?")
    (group,) = engine.generate([prompt], 3, 1.0, 1.0, 6, [7])
    assert len(group) == 3
    for s in group:
        assert len(s.logprobs) == len(s.tokens) and all(lp <= 0 for lp in s.logprobs)
        assert s.finish_reason == ("stop" if s.tokens and s.tokens[-1] == tok.eos_token_id else "length")
