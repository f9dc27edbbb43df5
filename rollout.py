"""rollout.py: the sampling engines. Both keep their own inference copy of the policy.

The trainer speaks to an engine through three calls:
    engine.generate(prompts, n, temperature, top_p, max_tokens, seeds, progress=False)
        -> [[Sample] * n for each prompt]
    engine.load_weights(named_tensors)   # the weights changed: (name, full tensor) pairs, one at a time
    engine.sleep()                       # rollout over: give the accelerator memory back to the trainer

HFEngine is `transformers.generate` (CPU, tests, small GPU runs); VLLMEngine is colocated vLLM (GPU).
Each sample comes from its own seed, so a rollout does not depend on how prompts are split across
ranks or batched.
"""
import importlib.util
from dataclasses import dataclass

import torch


@dataclass
class Sample:
    tokens: list            # response token ids, the stop token included
    finish_reason: str      # "stop" (an end-of-sequence token) or "length" (max_tokens reached)
    logprobs: list = None   # the sampler's log-prob of each token, where the engine reports them


class HFEngine:
    """Sampling with HF `generate` on a private copy of the model."""

    def __init__(self, model_path, device, dtype, eos_token_id):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
        eos = self.model.generation_config.eos_token_id  # may list several (Qwen3: <|im_end|>, <|endoftext|>)
        self.eos = {eos_token_id} | set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.device = device

    @torch.no_grad()
    def generate(self, prompts, n, temperature, top_p, max_tokens, seeds, progress=False):
        """All prompts in one left-padded batch. Each sample draws from its own seeded generator by
        Gumbel-max (argmax of logits/T + Gumbel noise is a draw from softmax(logits/T)), so what it
        samples does not depend on what else is in the batch."""
        rows = [p for p in prompts for _ in range(n)]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in rows], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=self.device)
        gens = [torch.Generator().manual_seed(seed * 1_000_003 + k) for seed in seeds for k in range(n)]
        sampler = [] if temperature == 0 else [lambda _, z: self._gumbel(z, temperature, top_p, gens)]
        seqs = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                                   logits_processor=sampler, eos_token_id=sorted(self.eos), pad_token_id=min(self.eos))
        samples = [self._sample(s[width:].tolist()) for s in seqs]
        return [samples[i * n:(i + 1) * n] for i in range(len(prompts))]

    @staticmethod
    def _gumbel(logits, temperature, top_p, gens):
        z = logits.float() / temperature
        if top_p < 1:  # keep the smallest set of tokens whose probability reaches top_p
            p, order = z.softmax(-1).sort(-1, descending=True)
            drop = p.cumsum(-1) - p >= top_p
            z = z.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        u = torch.stack([torch.rand(z.shape[-1], generator=g) for g in gens]).to(z.device).clamp_(1e-20, 1)
        return z - (-u.log()).log()

    def _sample(self, tokens):
        stop = next((i + 1 for i, t in enumerate(tokens) if t in self.eos), None)
        return Sample(tokens[:stop], "stop") if stop else Sample(tokens, "length")

    @torch.no_grad()
    def load_weights(self, named_tensors):
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            params[name].copy_(tensor)

    def sleep(self):
        pass


class VLLMEngine:
    """Colocated vLLM: one in-process engine per torchrun rank (external launcher, TP 1), asleep at level 2
    while the trainer works (every sync re-pushes all weights, so none are backed up in host memory). For
    training it starts from dummy weights: the first sync writes the real ones."""

    def __init__(self, model, rank, tok, max_model_len, gpu_memory_utilization, for_training=True):
        from vllm import LLM
        self.llm = LLM(model=model, distributed_executor_backend="external_launcher", tensor_parallel_size=1,
                       seed=rank, gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=for_training,
                       max_model_len=max_model_len, logprobs_mode="processed_logprobs",
                       load_format="dummy" if for_training else "auto", dtype="bfloat16")
        self.allowed = list(range(len(tok)))  # Qwen3's embedding has rows past the tokenizer (vLLM issue 13175)
        self.names = set(self.llm.apply_model(lambda m: [k for k, _ in m.named_parameters()])[0])
        self.sleeping, self.device = False, "cuda" if torch.cuda.is_available() else "cpu"
        if for_training:
            self.sleep()

    def generate(self, prompts, n, temperature, top_p, max_tokens, seeds, progress=False):
        from vllm import SamplingParams
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=-1, max_tokens=max_tokens,
                                 logprobs=0, seed=seed, allowed_token_ids=self.allowed) for seed in seeds]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=progress)
        return [[Sample(list(c.token_ids), "length" if c.finish_reason == "length" else "stop",
                        [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]) for c in o.outputs] for o in outs]

    @torch.no_grad()
    def load_weights(self, named_tensors):
        """Wake the weights, push every parameter (HF names; vLLM maps them onto its fused qkv and gate_up),
        wake the KV cache, drop the prefix cache, then check that the weights really arrived."""
        if self.sleeping:
            self.llm.wake_up(tags=["weights"])
        model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        sums = {}
        for name, tensor in named_tensors:
            tensor = tensor.to(self.device, torch.bfloat16)
            model.load_weights([(name, tensor)])
            if name in self.names:
                sums[name] = checksum(tensor)
            del tensor
        torch.cuda.empty_cache()  # a no-op without CUDA
        self.llm.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()  # KV computed with the old weights must never be reused
        self.sleeping = False
        self.self_check(sums)

    def self_check(self, sums):
        """Read parameters back out of vLLM and compare them with what the trainer sent: the final norm
        (and an untied lm_head) must have arrived, and the first and last pushed must hold their values."""
        missing = ({"model.norm.weight", "lm_head.weight"} & self.names) - sums.keys()
        if missing:
            raise RuntimeError(f"vLLM weight sync: {sorted(missing)} never pushed (a partial sync)")
        probe = list(sums)[:1] + list(sums)[-1:]
        got = self.llm.apply_model(lambda m: [checksum(dict(m.named_parameters())[n]) for n in probe])[0]
        for name, back in zip(probe, got):
            if any(abs(x - y) > 1e-3 * max(1.0, abs(x)) for x, y in zip(sums[name], back)):
                raise RuntimeError(f"vLLM weight sync: {name} reads back {back}, the trainer sent {sums[name]} "
                                   "(a stale sync)")

    def sleep(self):
        self.llm.sleep(level=2)
        self.sleeping = True


def checksum(t):
    t = t.detach().float()
    return float(t.sum()), float(t.norm())


def make_engine(kind, model, tok, device, rank, max_model_len, gpu_memory_utilization, for_training=True):
    """--engine auto: vLLM when CUDA and vllm are present, else HF generate."""
    if kind == "auto":
        kind = "vllm" if device.type == "cuda" and importlib.util.find_spec("vllm") else "hf"
    if kind == "vllm":
        return VLLMEngine(model, rank, tok, max_model_len, gpu_memory_utilization, for_training)
    return HFEngine(model, device, torch.bfloat16 if device.type == "cuda" else torch.float32, tok.eos_token_id)
