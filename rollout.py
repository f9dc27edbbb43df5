"""rollout.py: the sampling engines. Both keep their own inference copy of the policy.

The trainer speaks to an engine through three calls:
    engine.generate(prompts, n, temperature, top_p, max_tokens, seeds, progress=False)
        -> [[Sample] * n for each prompt]
    engine.load_weights(named_tensors)   # the weights changed: (name, full tensor) pairs, one at a time
    engine.sleep()                       # rollout over: give the accelerator memory back to the trainer

HFEngine is `transformers.generate` (CPU, tests, small GPU runs); VLLMEngine is colocated vLLM (GPU).
Each prompt's samples come from its own seed, so a rollout does not depend on how prompts are split
across ranks or batched.
"""
from dataclasses import dataclass

import torch


@dataclass
class Sample:
    tokens: list            # response token ids, the stop token included
    finish_reason: str      # "stop" (an end-of-sequence token) or "length" (max_tokens reached)
    logprobs: list = None   # the sampler's log-prob of each token, where the engine reports them


class HFEngine:
    """Sampling with HF `generate`, one prompt's group per call, on a private copy of the model."""

    def __init__(self, model_path, device, dtype, eos_ids):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
        self.eos, self.device = set(eos_ids), device

    @torch.no_grad()
    def generate(self, prompts, n, temperature, top_p, max_tokens, seeds, progress=False):
        from tqdm import tqdm
        out = []
        for prompt, seed in tqdm(list(zip(prompts, seeds)), disable=not progress, desc="generate"):
            torch.manual_seed(seed)
            ids = torch.tensor([prompt] * n, device=self.device)
            greedy = temperature == 0
            seqs = self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                do_sample=not greedy, temperature=None if greedy else temperature, top_p=None if greedy else top_p,
                top_k=None if greedy else 0, eos_token_id=sorted(self.eos), pad_token_id=sorted(self.eos)[0])
            out.append([self._sample(s[len(prompt):].tolist()) for s in seqs])
        return out

    def _sample(self, tokens):
        stop = next((i for i, t in enumerate(tokens) if t in self.eos), None)
        if stop is None:
            return Sample(tokens, "length")
        return Sample(tokens[:stop + 1], "stop")

    @torch.no_grad()
    def load_weights(self, named_tensors):
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            params[name].copy_(tensor)

    def sleep(self):
        pass


def eos_ids(model_path, tok):
    """The ids that end a response: the generation config's, else the tokenizer's."""
    from transformers import GenerationConfig
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = None
    eos = eos if eos is not None else tok.eos_token_id
    return sorted(set(eos if isinstance(eos, list) else [eos]))


def make_engine(kind, model, device, rank, max_model_len, gpu_memory_utilization):
    """--engine auto: vLLM when CUDA and vllm are present, else HF generate."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    if kind == "auto":
        try:
            import vllm  # noqa: F401
            kind = "vllm" if device.type == "cuda" else "hf"
        except ImportError:
            kind = "hf"
    if kind == "vllm":
        return VLLMEngine(model, rank, tok, max_model_len, gpu_memory_utilization)
    return HFEngine(model, device, torch.bfloat16 if device.type == "cuda" else torch.float32, eos_ids(model, tok))
