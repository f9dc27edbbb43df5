"""rollout.py: the engines. Prompts in, samples out, and the trainer's weights in after every step.

The trainer and eval.py speak to an engine through five calls (and engine.close() after their last collective):
    engine.generate(prompts, n, temperature, top_p, max_tokens, seeds, progress=False, logprobs=True)
        -> [[Sample] * n per prompt]; sample j of seed s draws from seed s + j; logprobs=False: no sampler's
    engine.load_weights(named_tensors)   # the weights changed: (HF name, full tensor) pairs, one at a time
    engine.weight_digest()               # {part: digest} of the weights it computes with: the sync's proof
    engine.logprobs_of(tokens)           # log p of tokens[1:] given their prefix: the sync's self-check
    engine.sleep()                       # rollout over: give the accelerator memory back to the trainer

HFEngine decodes with a transformers model (CPU, tests, small runs); VLLMEngine is colocated vLLM 0.32 (GPU, and
vLLM's CPU build). Both follow vLLM's seeding rule: a sample's noise depends on neither the batch nor the rank.
Its logits do on a GPU, unless VLLM_BATCH_INVARIANT=1; on the CPU engines (HF on CPU, vLLM's CPU build) not.
VLLM_BATCH_INVARIANT=1 is process-wide, and the colocated engine lives in the trainer's process. On CUDA vLLM
0.32 (model_executor/determinism/batch_invariant.py, init_batch_invariance) swaps aten's CUDA kernels of
mean.dim, softmax, _softmax, _log_softmax and bmm for Triton ones (on SM 8.x also mm, addmm, matmul and
linear, whose backward then has no CUDA kernel: the trainer's backward would raise), turns TF32 and
reduced-precision bf16/fp16 reductions off, prefers cuBLASLt, and sets cuBLAS's workspace and NCCL's channels
(one) for what is made after. The trainer then runs slower and rounds differently. Read, not run
(docs/evaluation.md).
vLLM's CPU build has no sleep mode (VLLMEngine.sleep() does nothing there), runs eager, without chunked
prefill (seeded requests fail under it on CPU), and emulates bf16, slower.
"""
import functools
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, StaticCache

from parallel import full_tensor


@dataclass
class Sample:
    tokens: list            # response token ids, the stop token included
    finish_reason: str      # "stop" (an end-of-sequence token) or "length" (max_tokens reached)
    logprobs: list = None   # the sampler's log-prob of each token, where the engine reports them


def sample_token(logits, u, temperature, top_p=1.0):
    """One token per row of logits [rows, V], drawn from softmax(logits / temperature), top-p truncated,
    by inverse CDF: the first token whose cumulative probability exceeds u * total. u: [rows] uniforms in
    [0, 1). The probabilities are summed in float64, so even a token of probability 1e-12 is drawn at its own
    rate. Temperature 0: argmax."""
    if temperature == 0:
        return logits.argmax(-1)
    p = (logits.float() / temperature).softmax(-1)
    if top_p < 1:  # keep the smallest set of tokens whose probability reaches top_p
        top, order = p.sort(-1, descending=True)
        drop = top.cumsum(-1) - top >= top_p
        p = p.masked_fill(drop.scatter(-1, order, drop), 0.0)
    cdf = p.double().cumsum(-1)  # twice as fast as cumsum(dtype=float64) on CPU, the same sums
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]


class HFEngine:
    """Sampling on a private copy of the model, decoded by a short KV-cache loop of our own."""

    def __init__(self, model_path, device, dtype, eos_token_id, for_training=False):
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
        eos = self.model.generation_config.eos_token_id  # may list several (Qwen3: <|im_end|>, <|endoftext|>)
        self.eos = {eos_token_id} | set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.device, self.dtype, self.for_training = device, dtype, for_training
        self.parked = None  # asleep on CUDA: the weights in host memory (park); {}: dropped, in training

    @torch.inference_mode()  # no autograd bookkeeping at all: a tenth of a small model's decode step
    def generate(self, prompts, n, temperature, top_p, max_tokens, seeds, progress=False, logprobs=True):
        """All prompts in one left-padded batch, decoded token by token with a KV cache (HF `generate`'s
        per-token bookkeeping costs more than this tiny model's forward). Sample j of the prompt seeded s
        draws its t-th token with the t-th uniform of its own generator seeded s + j (sample_token), so
        what it samples does not depend on what else is in the batch. It reports no sampler log-probs."""
        rows = [p for p in prompts for _ in range(n)]
        if not rows:
            return []
        self.wake()
        ids, real, width = left_padded(rows, max_tokens, self.device)
        gens = [torch.Generator().manual_seed(seed + j) for seed in seeds for j in range(n)]
        cache = StaticCache(config=self.model.config, max_cache_len=width + max_tokens)
        eos = torch.tensor(sorted(self.eos), device=self.device)
        done = torch.zeros(len(rows), dtype=torch.bool, device=self.device)
        for t in range(max_tokens):
            if t % 256 == 0:  # the next 256 uniforms of every sample's own stream
                draws = [torch.rand(256, generator=g, dtype=torch.float64) for g in gens]
                u = torch.stack(draws).to(self.device)
            now = slice(0 if t == 0 else width + t - 1, width + t)  # the prompts, then the last token
            positions = (real[:, :now.stop].cumsum(-1) - 1).clamp(min=0)[:, now]
            logits = self.model(input_ids=ids[:, now], attention_mask=real[:, :now.stop],
                                position_ids=positions, past_key_values=cache, logits_to_keep=1).logits[:, -1]
            token = sample_token(logits, u[:, t % 256], temperature, top_p)
            ids[:, width + t] = token.masked_fill(done, min(self.eos))  # a finished row repeats an end token
            real[:, width + t] = 1
            done |= torch.isin(ids[:, width + t], eos)
            if done.all():
                break
        samples = [self._sample(s) for s in ids[:, width:width + t + 1].tolist()]
        return [samples[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _sample(self, tokens):
        stop = next((i + 1 for i, t in enumerate(tokens) if t in self.eos), None)
        return Sample(tokens[:stop], "stop") if stop else Sample(tokens, "length")

    @torch.no_grad()
    def load_weights(self, named_tensors):
        """The trainer's weights, copied in; into an engine whose weights its sleep dropped (training on
        CUDA), each made anew on the device from the tensor pushed, with no copy through host memory."""
        params = dict(self.model.named_parameters(remove_duplicate=False))  # a tied lm_head has its name
        if self.parked == {}:
            for name, tensor in named_tensors:
                params[name].data = tensor.to(self.device, self.dtype, copy=True)
            self.parked = None
            missing = [name for name, p in params.items() if p.numel() == 0]
            if missing:
                raise RuntimeError(f"HF engine: the weight sync left {len(missing)} weights unset ({missing[0]}, ...)")
            return
        self.wake()
        for name, tensor in named_tensors:
            params[name].copy_(tensor)

    @torch.no_grad()
    def weight_digest(self):
        """{part: digest} of the weights the model computes with (WeightDigest), a tied head under its name."""
        self.wake()
        return digest_of(self.model.named_parameters(remove_duplicate=False), self.dtype)

    @torch.no_grad()
    def logprobs_of(self, tokens):
        self.wake()
        logits = self.model(torch.tensor([tokens], device=self.device)).logits[0, :-1].float()
        targets = torch.tensor(tokens[1:], device=self.device)
        return logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0].tolist()

    def sleep(self):
        """Rollout over. On CUDA the weights leave the device and torch's cached blocks go back to the driver,
        so the trainer, or eval.py's judge in a process of its own, can have that memory. In training they are
        dropped (the next sync writes every one of them anew: load_weights); otherwise they wait in host memory
        and the next call brings them back, bit for bit. On the CPU nothing moves."""
        if self.device.type == "cuda":
            self.park(keep=not self.for_training)
            torch.cuda.empty_cache()

    def park(self, keep=True):
        """Each weight's tensor on the device replaced by an empty one, after a copy to host memory (keep)."""
        if self.parked is None:
            params = list(self.model.named_parameters())  # a tied weight once
            self.parked = {name: p.detach().to("cpu", copy=True) for name, p in params} if keep else {}
            for _, p in params:
                p.data = p.data.new_empty(0)

    def wake(self):
        if self.parked == {}:
            raise RuntimeError("HF engine: its weights were dropped at its sleep, for training; a weight sync "
                               "(load_weights) brings them back")
        if self.parked is not None:
            for name, p in self.model.named_parameters():
                p.data = self.parked[name].to(self.device)
            self.parked = None

    def close(self):
        """The program's end: a transformers model needs no shutdown."""


def left_padded(rows, max_tokens, device):
    """Prompts left-padded to one width, with room for max_tokens after it: (ids, the attention mask, width).
    Preallocated: tensors that grow every token fragment the heap (GBs of resident set at V = 152k)."""
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width + max_tokens, dtype=torch.long, device=device)
    real = torch.zeros_like(ids)  # 1 at each prompt and sampled token
    for k, p in enumerate(rows):
        ids[k, width - len(p):width] = torch.tensor(p)
        real[k, width - len(p):width] = 1
    return ids, real, width


class VLLMEngine:
    """Colocated vLLM: one in-process engine per torchrun rank (external launcher, TP 1), and one per
    process for the life of the process: vLLM keeps process-wide state for one engine (its rotary cache,
    its CuMem allocator; docs/evaluation.md). On GPU: asleep at level 2 while the trainer works (every
    sync re-pushes all weights, so none are backed up in host memory); fp32 dot products in Triton's
    attention are true fp32. On vLLM's CPU build see the module's docstring."""

    def __init__(self, model, max_model_len, gpu_memory_utilization, for_training=True, dtype=None):
        from vllm import LLM
        self.cuda, self.asleep = torch.cuda.is_available(), False
        self.dtype = dtype or compute_dtype("auto", torch.device("cuda" if self.cuda else "cpu"))
        claim_the_process(model, true_fp32=self.cuda and self.dtype == torch.float32)
        self.logprobs = 0 if for_training else None  # the sampler's log-prob of each token: training only
        self.llm = LLM(model=model, **vllm_options(self.cuda, self.dtype, max_model_len, gpu_memory_utilization,
                                                   for_training))
        if for_training:  # its dummy weights wait for the first sync
            self.sleep()

    def generate(self, prompts, n, temperature, top_p, max_tokens, seeds, progress=False, logprobs=True):
        """No allowed_token_ids: the trainer's log-probs are over the whole embedding, padded rows included, so
        the sampler draws from all of it (vLLM caps the list at 1,024). logprobs=False: no sampler log-probs."""
        from vllm import SamplingParams
        if not prompts:
            return []
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=-1, seed=s, max_tokens=max_tokens,
                                 logprobs=self.logprobs if logprobs else None, detokenize=False) for s in seeds]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=progress)
        return [[vllm_sample(c) for c in out.outputs] for out in outs]

    @torch.no_grad()
    def load_weights(self, named_tensors):
        """Free the trainer's cached blocks, wake the weights, reload them in place, wake the KV cache and
        drop the prefix cache (KV of old weights must never be reused). Tensors come one at a time, ideally
        in self.dtype here; `reload_weights` maps HF names onto vLLM's fused layers, re-running each named
        layer's post-load processing (CPU repacking too): a tied lm_head must come under its own name too."""
        if self.cuda:
            torch.cuda.empty_cache()
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
        if not self.llm.reset_prefix_cache():  # False, not an error, while blocks are held
            raise RuntimeError("vLLM could not reset its prefix cache after a weight sync: KV computed "
                               "with the old weights could be reused")
        self.asleep = False

    def weight_digest(self):
        """{part: digest} of the weights vLLM's worker computes with (vllm_weights, WeightDigest)."""
        return self.llm.apply_model(functools.partial(vllm_digest, dtype=self.dtype))[0]

    def logprobs_of(self, tokens):
        from vllm import SamplingParams
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        (out,) = self.llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
        return [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], tokens[1:])]

    def sleep(self):
        if self.cuda:
            self.llm.sleep(level=2)
            self.asleep = True

    def close(self):
        """At a program's end: vLLM's own shutdown (vLLM 0.32's LLM has none of its own), the engine core's,
        which frees its workers, their CuMem pools and caches, before the interpreter's teardown. Woken first:
        the CuMem allocator frees a sleeping engine's memory by unmapping it again, and prints CUDA errors.
        It also destroys torch's default process group (cleanup_dist_env_and_memory): call it after the last
        collective. A wake that fails (out of memory, with an error's traceback still holding the trainer's
        tensors) does not stop the shutdown. Its failure, or the shutdown's, is raised after it, unless
        another exception is on its way (close from a `finally` or `closing`): that one stays the error
        reported, and close's own is one warning line on stderr."""
        if self.llm is None:
            return
        llm, asleep, self.llm, self.asleep = self.llm, self.asleep, None, False
        failed = []
        if asleep:
            try:
                llm.wake_up()
            except Exception as e:  # noqa: BLE001  (out of memory, say: the shutdown runs all the same)
                failed.append(e)
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as e:  # noqa: BLE001
            failed.append(e)
        if failed and sys.exc_info()[1] is None:  # no other error on its way: close's own is the error
            raise failed[-1] from (failed[0] if len(failed) == 2 else None)
        if failed:
            print("rollout: warning: closing the vLLM engine during another error, which stays the one "
                  "reported: " + "; then ".join(" ".join(f"{type(e).__name__}: {e}".split()) for e in failed),
                  file=sys.stderr, flush=True)


ENGINE_PIDS = []  # the process that built this process's vLLM engine


def claim_the_process(model, true_fp32):
    """The process-wide settings of this process's one vLLM engine: a second engine is refused, the external
    launcher's two variables are set, and the reload's rotary warning is filtered."""
    if ENGINE_PIDS:
        raise RuntimeError(f"a second vLLM engine ({model}) in process {os.getpid()}: vLLM keeps "
                           "process-wide state for one engine; build it in a process of its own")
    ENGINE_PIDS.append(os.getpid())
    os.environ.setdefault("RANK", str(dist.get_rank() if dist.is_initialized() else 0))
    os.environ.setdefault("LOCAL_RANK", "0")
    if true_fp32:  # Triton's tl.dot takes fp32 inputs as TF32 unless told
        os.environ["TRITON_F32_DEFAULT"] = "ieee"
    logging.getLogger(RELOAD_LOGGER).addFilter(not_rotary_reload_noise)


def vllm_options(cuda, dtype, max_model_len, gpu_memory_utilization, for_training):
    """What the colocated engine asks of vLLM's LLM(): TP 1 under torchrun, sleep mode on GPU, the
    sampler's processed log-probs, dummy weights for training (the first sync writes the real ones)."""
    cpu_only = {} if cuda else {"enforce_eager": True, "enable_chunked_prefill": False}
    return dict(distributed_executor_backend="external_launcher", tensor_parallel_size=1, seed=0,
                dtype=str(dtype)[6:], gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=cuda,
                max_model_len=max_model_len, logprobs_mode="processed_logprobs",
                load_format="dummy" if for_training else "auto",
                cpu_distributed_timeout_seconds=7200, **cpu_only)  # vLLM's own groups: 2 h too


def vllm_sample(c):
    """A vLLM completion as a Sample, with the sampler's log-prob of each of its tokens."""
    logprobs = c.logprobs and [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
    return Sample(list(c.token_ids), "length" if c.finish_reason == "length" else "stop", logprobs)
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def not_rotary_reload_noise(record):
    """False for "RotaryEmbedding: Failed to load weights", which every reload logs: nothing sends the
    rotary cache (a non-persistent buffer), and vLLM keeps it as it was (docs/memory.md)."""
    return not (record.msg == "%s: Failed to load weights" and str(record.args[0]).endswith("RotaryEmbedding"))


def full_params(lm, dtype):
    """(HF name, full tensor) per parameter, in the same order on every rank (a collective). Each
    shard is cast to the engine's dtype before the all-gather: bf16 halves traffic and memory. A
    tied lm_head goes under its own name too: vLLM reloads each layer from the names it receives."""
    for name, p in lm.named_parameters(remove_duplicate=False):
        yield name, full_tensor(p.detach().to(dtype))


# ---- the sync's proof: a digest of the weights the engine computes with ---------------------------------

def push_weights(engine, lm):
    """The weight sync (stapo.sync_engine): every parameter of lm pushed into the engine (full_params),
    then proved exact. Its digest is taken on the way in, from the tensors pushed, one at a time, on their
    device (no second all-gather); the engine's from the weights it computes with (weight_digest). Raises
    unless the two agree in every part of the model, bit for bit: a sync that pushed nothing, part of the
    weights or a tied head under the embedding's name alone fails in bf16 as in fp32, even one optimizer
    step at lr 1e-6 behind, which the probe's log-probs cannot tell from bf16's noise (docs/training.md)."""
    pushed = WeightDigest(engine.dtype)
    engine.load_weights(pushed.passing(full_params(lm, engine.dtype)))
    check_weights(pushed.result(), engine.weight_digest())


def check_weights(pushed, held):
    """Raises unless each part of the model (digest_group) has the same digest in the engine as pushed."""
    differ = [g for g in held if g in pushed and pushed[g] != held[g]]
    unsent, unknown = [g for g in held if g not in pushed], [g for g in pushed if g not in held]
    if differ or unsent or unknown:
        said = [f"other weights than those pushed in {', '.join(differ)}" if differ else "",
                f"nothing pushed for {', '.join(unsent)}" if unsent else "",
                f"no part named {', '.join(unknown)}, which was pushed" if unknown else ""]
        raise RuntimeError(f"engine weight sync: the engine holds {'; '.join(x for x in said if x)} "
                           f"({len(differ) + len(unsent) + len(unknown)} of {len(held | pushed)} parts): a stale, "
                           "partial or mis-mapped sync")


def digest_group(name):
    """The part of the model a weight counts in: its decoder layer ("model.layers.3"), else its module
    ("model.embed_tokens", "model.norm", "lm_head"). HF's names and vLLM's agree on these parts, whose
    digests do not see how vLLM fuses their weights (qkv_proj, gate_up_proj) or lays them out."""
    head, layers, rest = name.partition(".layers.")
    return head + layers + rest.split(".")[0] if layers else name.rpartition(".")[0]


HASH_MULTIPLIER = 0x45D9F3B  # hash32: a bijection of 32-bit integers (xor-shift, multiply; twice; xor-shift)


def hash32(bits):
    """int64 values in [0, 2^32): each one's 32-bit hash, in int64; no product reaches 2^59, so every
    device computes it exactly."""
    bits = ((bits >> 16) ^ bits) * HASH_MULTIPLIER & 0xFFFFFFFF
    bits = ((bits >> 16) ^ bits) * HASH_MULTIPLIER & 0xFFFFFFFF
    return (bits >> 16) ^ bits


def value_hashes(x):
    """Each value's hash32, of its fp32 bit pattern (exact for bf16 values), -0 counted as +0."""
    return hash32((x.float() + 0.0).view(torch.int32).long() & 0xFFFFFFFF)


class WeightDigest:
    """Per part of the model (digest_group), the sum over its weights' values of each value's hash32, in
    int64: exact, so the same weights give the same digest in bf16 as in fp32, and any changed value
    changes it (hash32 is a bijection: two values that move one ulp each way do not cancel, as their bit
    patterns' sum would). A sum, so the order of values and tensors does not count: a fused qkv_proj has
    the digest of its q, k and v, a weight that of its transpose or its packed copy. Values are taken in
    `dtype`, the engine's. Below 2^31 values per part (a decoder layer of Qwen3-14B has 2^28), no sum
    overflows."""

    CHUNK = 1 << 24  # values hashed at a time: in bf16, 256 MB of temporaries at most

    def __init__(self, dtype):
        self.dtype, self.sums, self.tables = dtype, {}, {}

    def add(self, name, tensor):
        """tensor's values into name's part; on its device, nothing read back."""
        group, flat = digest_group(name), tensor.detach().reshape(-1)
        for part in flat.split(self.CHUNK):
            self.sums[group] = self.sums.get(group, 0) + self.hashes(part.to(self.dtype)).sum()

    def hashes(self, x):
        """value_hashes; in bf16 by a table of the 2^16 values' hashes, a tenth of the work."""
        if x.dtype != torch.bfloat16:
            return value_hashes(x)
        if x.device not in self.tables:  # bf16 bit pattern b (as int16) is fp32 bit pattern b * 2^16 (as int32)
            patterns = torch.arange(-1 << 15, 1 << 15, dtype=torch.int32, device=x.device) * (1 << 16)
            self.tables[x.device] = value_hashes(patterns.view(torch.float32))
        return self.tables[x.device][x.view(torch.int16).int().add_(1 << 15)]

    def passing(self, named_tensors):
        """named_tensors as they are, each added on its way through."""
        for name, tensor in named_tensors:
            self.add(name, tensor)
            yield name, tensor

    def result(self):
        """{part: int}: the one read back from the device."""
        return dict(zip(self.sums, torch.stack(list(self.sums.values())).tolist())) if self.sums else {}


def digest_of(named_tensors, dtype):
    """{part: digest} of (name, tensor) pairs (WeightDigest)."""
    digest = WeightDigest(dtype)
    for name, tensor in named_tensors:
        digest.add(name, tensor)
    return digest.result()


READ_BACK_ROWS = 1024  # identity rows per packed read-back


def vllm_weights(model):
    """(name, tensor) of the weights a vLLM model computes with, in its worker. A layer that multiplies by a
    packed copy of its weight (vLLM's CPU build: `cpu_linear`, the `weight` parameter emptied, or for the LM
    head kept beside the copy, which a tied head sent only under the embedding's name leaves stale) is read
    back through that copy: identity rows in, its weight's columns out, exactly (one product by 1 per value).
    Everything else as stored (on a GPU, every weight), vocabulary padding left out."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    for prefix, module in model.named_modules():
        vocab = module.num_embeddings if isinstance(module, VocabParallelEmbedding) else None
        for key, p in module.named_parameters(recurse=False):
            name = f"{prefix}.{key}" if prefix else key
            lookup = isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead)
            if key == "weight" and hasattr(module, "cpu_linear") and not lookup:  # an embedding looks up p
                k = module.input_size_per_partition
                eye = torch.eye(k, dtype=p.dtype, device=p.device)
                for i in range(0, k, READ_BACK_ROWS):
                    yield name, module.cpu_linear(eye[i:i + READ_BACK_ROWS], p, None)[:, :vocab]
            elif p.numel():
                yield name, p[:vocab]


def vllm_digest(model, dtype):
    """On vLLM's worker (LLM.apply_model): the digest of the weights its model computes with."""
    return digest_of(vllm_weights(model), dtype)


def sampler_logprobs(samples, valid):
    """[N, R] the sampler's log-prob of each sampled token (vLLM reports them), or None."""
    if samples[0].logprobs is None:
        return None
    out = torch.zeros(valid.shape, device=valid.device)
    out[valid] = torch.tensor([x for s in samples for x in s.logprobs], device=valid.device)
    return out


def engine_kind(flag, device):
    """--engine auto|vllm|hf: the engine it builds on `device` (auto: vLLM when CUDA and vllm are present)."""
    if flag == "auto":
        return "vllm" if torch.device(device).type == "cuda" and importlib.util.find_spec("vllm") else "hf"
    return flag


def make_engine(kind, model, tok, device, max_model_len, gpu_memory_utilization, for_training=True,
                dtype=None):
    """The engine of --engine `kind` (engine_kind). dtype: the engine's weights (default: bf16 on CUDA, fp32
    on CPU)."""
    dtype = dtype or compute_dtype("auto", device)
    if engine_kind(kind, device) == "vllm":
        return VLLMEngine(model, max_model_len, gpu_memory_utilization, for_training, dtype)
    return HFEngine(model, device, dtype, tok.eos_token_id, for_training)


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def compute_dtype(flag, device):
    """--dtype auto|bf16|fp32: the trainer's compute dtype and the engine's (auto: bf16 on CUDA)."""
    if flag == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[flag]
