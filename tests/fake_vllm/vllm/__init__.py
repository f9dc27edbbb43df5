"""A fake `vllm` for CPU tests: `LLM` and `SamplingParams` with the call shapes VLLMEngine uses.

Every call is recorded in CALLS, in order. Sampling is real (HF generate on the model the engine was
built from, with the weights that load_weights wrote), and so are the log-probs it reports, so
training steps through rollout.VLLMEngine are real steps. FAULTS["stale"] makes load_weights drop
what it is given, as a broken name mapping would.
"""
from types import SimpleNamespace

import torch

CALLS, FAULTS = [], {"stale": False}


class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw


class _Runner:
    def __init__(self, hf):
        self.hf = hf

    def load_weights(self, weights):
        params = dict(self.hf.named_parameters())
        for name, tensor in weights:
            CALLS.append(("load_weights", name, tensor.detach().clone()))
            if not FAULTS["stale"]:
                params[name].data.copy_(tensor)


class LLM:
    def __init__(self, model, **kwargs):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        CALLS.append(("LLM", {"model": model, **kwargs}))
        self.hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        if kwargs.get("load_format") == "dummy":
            for p in self.hf.parameters():
                torch.nn.init.uniform_(p.data, -1e-3, 1e-3)
        self.eos = AutoTokenizer.from_pretrained(model).eos_token_id
        runner = SimpleNamespace(model=_Runner(self.hf))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner)))

    def sleep(self, level=1):
        CALLS.append(("sleep", level))

    def wake_up(self, tags=None):
        CALLS.append(("wake_up", tuple(tags or ())))

    def reset_prefix_cache(self):
        CALLS.append(("reset_prefix_cache",))

    def apply_model(self, func):
        return [func(self.hf)]

    @torch.no_grad()
    def generate(self, prompts, sampling_params, use_tqdm=True):
        CALLS.append(("generate", [p["prompt_token_ids"] for p in prompts], [sp.kw for sp in sampling_params]))
        outs = []
        for prompt, sp in zip(prompts, sampling_params):
            kw, ids = sp.kw, prompt["prompt_token_ids"]
            torch.manual_seed(kw["seed"])
            seqs = self.hf.generate(input_ids=torch.tensor([ids] * kw["n"]), attention_mask=torch.ones(kw["n"], len(ids)),
                                    do_sample=True, temperature=kw["temperature"], top_p=kw["top_p"], top_k=0,
                                    max_new_tokens=kw["max_tokens"], eos_token_id=self.eos, pad_token_id=self.eos)
            completions = []
            for seq in seqs.tolist():
                out = seq[len(ids):]
                stop = out.index(self.eos) + 1 if self.eos in out else None
                out = out[:stop]
                logits = self.hf(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1] / kw["temperature"]
                lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(out)[:, None])[:, 0].tolist()
                completions.append(SimpleNamespace(token_ids=out, finish_reason="stop" if stop else "length",
                                                   logprobs=[{t: SimpleNamespace(logprob=v)} for t, v in zip(out, lp)]))
            outs.append(SimpleNamespace(outputs=completions))
        return outs
