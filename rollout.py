"""rollout.py: problems in, samples out. Data, prompts and logs, the process group, the two engines.

The trainer and eval.py speak to an engine through four calls:
    engine.generate(prompts, n, temperature, top_p, max_tokens, seeds, progress=False)
        -> [[Sample] * n for each prompt]; sample j of the prompt seeded s draws from seed s + j
    engine.load_weights(named_tensors)   # the weights changed: (HF name, full tensor) pairs, one at a time
    engine.logprobs_of(tokens)           # log p of tokens[1:] given their prefix: the sync's self-check
    engine.sleep()                       # rollout over: give the accelerator memory back to the trainer

HFEngine decodes with a transformers model (CPU, tests, small runs); VLLMEngine is colocated vLLM 0.32
(GPU, and vLLM's CPU build). Both follow vLLM's seeding rule, so a rollout depends on neither the batch nor
the rank.
"""
import hashlib, importlib.util, json, os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

SUFFIX = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should "
               "be of the form Answer: $Answer (without quotes) where $Answer is the answer to the "
               "problem.\n\n")
DAPO_SUFFIX = "\n\nRemember to put your answer on its own line after \"Answer:\"."
# The sync's self-check reads the engine's and the trainer's log-probs of this question and answer.
PROBE = ("What is the sum of the first 100 positive integers?",
         "Pair the first number with the last, the second with the one before last, and so on: "
         "1 + 100 = 101, 2 + 99 = 101, 3 + 98 = 101, and every one of the 50 pairs adds up to 101. "
         "The sum is therefore 50 \\times 101 = 5050. As a check, the formula n(n+1)/2 with n = 100 "
         "gives 100 \\cdot 101 / 2 = 10100 / 2 = 5050, the same number. The average of the numbers "
         "is (1 + 100) / 2 = 50.5, and 100 numbers of average 50.5 add up to 5050 again. So the "
         "sum of the first 100 positive integers is \\boxed{5050}.")


# ---- prompts, data and logs -----------------------------------------------------------------------------

def encode_prompt(tok, problem, chat_template=True, enable_thinking=False, suffix=SUFFIX):
    """Token ids of the paper's prompt: the problem + SUFFIX, as a user turn of the chat template."""
    text = problem + suffix
    if chat_template and tok.chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True, enable_thinking=enable_thinking)
    return tok(text, add_special_tokens=False)["input_ids"]


def encode_problems(tok, problems, max_prompt_len, chat_template=True, enable_thinking=False):
    """[(prompt ids, answer)] for (problem, answer) pairs, dropping prompts longer than max_prompt_len."""
    out = []
    for problem, answer in problems:
        ids = encode_prompt(tok, problem, chat_template, enable_thinking)
        if len(ids) <= max_prompt_len:
            out.append((ids, answer))
    return out


def read_jsonl(path, fields=()):
    """[("file:line", row)] of a .jsonl file; a line that is not a JSON object, or lacks one of `fields`,
    is an error naming the file, the line and the field."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{i}: not an object")
            missing = [k for k in fields if row.get(k) is None]
            if missing:
                raise ValueError(f"{path}:{i}: missing field {missing[0]!r}")
            rows.append((f"{path}:{i}", row))
    return rows


def append_jsonl(path, records):
    with open(path, "a") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)


def drop_steps_after(path, step):
    """Cut a log back to the checkpoint's step: a resumed run re-runs (and re-logs) the steps after it."""
    if os.path.exists(path):
        kept = [line for line in open(path) if json.loads(line)["step"] <= step]
        with open(path, "w") as f:
            f.writelines(kept)


class Reporter:
    """--report-to: each step's metrics also go to W&B or TensorBoard (imported only if asked)."""

    def __init__(self, kind, out, config):
        self.kind = kind
        if kind == "wandb":
            import wandb
            self.run = wandb.init(dir=out, config=config)
        if kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(os.path.join(out, "tensorboard"))

    def log(self, metrics):
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if self.kind == "wandb":
            self.run.log(numbers, step=metrics["step"])
        if self.kind == "tensorboard":
            for key, value in numbers.items():
                self.writer.add_scalar(key, value, metrics["step"])
            self.writer.flush()


def _problem_answer(row, where):
    if "prompt" not in row:
        missing = [k for k in ("problem", "answer") if row.get(k) is None]
        if missing:
            raise ValueError(f"{where}: missing field {missing[0]!r}")
        return row["problem"], str(row["answer"])
    try:  # DAPO-Math-17k's own schema: the problem inside its instruction wrapper, the gold in reward_model
        content, gold = row["prompt"][0]["content"], str(row["reward_model"]["ground_truth"])
    except (KeyError, IndexError, TypeError):
        fields = "'prompt[0].content' or 'reward_model.ground_truth'"
        raise ValueError(f"{where}: missing field {fields}") from None
    if content.startswith(DAPO_PREFIX) and content.endswith(DAPO_SUFFIX):
        content = content[len(DAPO_PREFIX):len(content) - len(DAPO_SUFFIX)]
    return content, gold


def load_problems(spec):
    """[(problem, answer)] from a local .jsonl/.parquet or a Hub dataset, duplicates of a problem dropped."""
    if spec.endswith(".jsonl"):
        rows = read_jsonl(spec)
    else:
        import datasets
        if spec.endswith(".parquet"):
            ds = datasets.load_dataset("parquet", data_files=spec)["train"]
        else:
            ds = datasets.load_dataset(spec, split="train")
        rows = [(f"{spec}: row {i}", r) for i, r in enumerate(ds)]
    seen, out = set(), []
    for where, row in rows:
        problem, answer = _problem_answer(row, where)
        if problem not in seen:
            seen.add(problem)
            out.append((problem, answer))
    return out


def step_prompts(data, step, args, rank, world):
    """This rank's share of step `step`'s prompts, mini-batch by mini-batch: mini-batch b is the same
    block of prompts whatever the world size. The data is shuffled anew (seeded) every epoch."""
    per_mb, n = args.prompts_per_step // args.minibatches, len(data)
    first_epoch = step * args.prompts_per_step // n
    last_epoch = ((step + 1) * args.prompts_per_step - 1) // n
    orders = {e: torch.randperm(n, generator=torch.Generator().manual_seed(args.seed * 7919 + e))
              for e in range(first_epoch, last_epoch + 1)}
    out = []
    for b in range(args.minibatches):
        first = step * args.prompts_per_step + b * per_mb + rank * (per_mb // world)
        for g in range(first, first + per_mb // world):
            out.append((g, *data[int(orders[g // n][g % n])]))
    return out


def seed_of(*parts):
    """A 62-bit seed for a tuple of integers (run seed, step, prompt...). Distinct tuples give unrelated
    seeds, so the samples s + j of one request never share noise with another request's."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


# ---- the process group ----------------------------------------------------------------------------------

def init_distributed():
    """torchrun's env, or a lone process as a world of one. Returns rank, world size, device, mesh.
    On GPU, gloo carries the CPU tensors (counts, metrics) and NCCL the CUDA ones, with a timeout long
    enough for a rank to wait out another's long rollout or checkpoint write. On one node the mesh is
    1-D (FSDP over every rank); on several it is 2-D, (nodes, ranks per node): HSDP shards within a
    node and replicates across nodes, so only the gradient all-reduce crosses the slower link."""
    from torch.distributed.device_mesh import init_device_mesh
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timedelta(hours=2))
        else:  # a plain `python stapo.py` (port 0: the OS picks a free one)
            dist.init_process_group(backend, init_method="tcp://127.0.0.1:0", rank=0, world_size=1,
                                    timeout=timedelta(hours=2))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_node == world:
        return dist.get_rank(), world, device, init_device_mesh(device.type, (world,))
    shape, names = (world // per_node, per_node), ("replicate", "shard")
    return dist.get_rank(), world, device, init_device_mesh(device.type, shape, mesh_dim_names=names)


def gather(obj):
    """Every rank's obj, in rank order."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def all_reduce_numbers(*xs, op=dist.ReduceOp.SUM):
    """A few numbers reduced over ranks (summed, or `op`): a CPU tensor, which gloo carries also on GPU."""
    t = torch.tensor([float(x) for x in xs], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()


def gather_cat(x):
    """Concatenate a 1-D tensor of any length from every rank."""
    return torch.cat(gather(x.cpu()))


def require_shared(sees, out, what):
    """Raise on every rank at once (no rank is left waiting in a collective) if one `sees` not."""
    blind = [r for r, ok in enumerate(gather(bool(sees))) if not ok]
    if blind:
        raise RuntimeError(f"--out {out}: rank(s) {blind} {what}. On several nodes, --out must be "
                           "a folder every node sees (a shared filesystem): each rank writes its "
                           "shard of every checkpoint there, and --resume reads them all back")


def check_shared_out(out, rank):
    """Rank 0 writes a fresh token into --out; every rank must read it back."""
    token, path = gather(os.urandom(8).hex())[0], os.path.join(out, ".run_token")
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        with open(path, "w") as f:
            f.write(token)
    dist.barrier()
    sees = os.path.exists(path) and open(path).read() == token
    require_shared(sees, out, "cannot see what rank 0 wrote there")


def memory_peak():
    """GiB, and reset: on CUDA torch's peak allocation (the trainer's tensors; vLLM's own pool aside),
    on CPU the process's peak resident set (Linux), each since the previous call."""
    if torch.cuda.is_available():
        gb = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        return gb
    with open("/proc/self/status") as f:
        gb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from the resident set now
    return gb


# ---- the engines -----------------------------------------------------------------------------------------

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

    def __init__(self, model_path, device, dtype, eos_token_id):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
        eos = self.model.generation_config.eos_token_id  # may list several (Qwen3: <|im_end|>, <|endoftext|>)
        self.eos = {eos_token_id} | set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.device, self.dtype = device, dtype

    @torch.inference_mode()  # no autograd bookkeeping at all: a tenth of a small model's decode step
    def generate(self, prompts, n, temperature, top_p, max_tokens, seeds, progress=False):
        """All prompts in one left-padded batch, decoded token by token with a KV cache (HF `generate`'s
        per-token bookkeeping costs more than this tiny model's forward). Sample j of the prompt seeded s
        draws its t-th token with the t-th uniform of its own generator seeded s + j (sample_token), so
        what it samples does not depend on what else is in the batch."""
        from transformers import StaticCache
        rows = [p for p in prompts for _ in range(n)]
        if not rows:
            return []
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width + max_tokens, dtype=torch.long, device=self.device)
        real = torch.zeros_like(ids)  # the attention mask: 1 at each prompt and sampled token
        for k, p in enumerate(rows):
            ids[k, width - len(p):width] = torch.tensor(p)
            real[k, width - len(p):width] = 1
        gens = [torch.Generator().manual_seed(seed + j) for seed in seeds for j in range(n)]
        # preallocated, like ids: tensors that grow every token fragment the heap (GBs of RSS at V = 152k)
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
        params = dict(self.model.named_parameters(remove_duplicate=False))  # a tied lm_head has its name
        for name, tensor in named_tensors:
            params[name].copy_(tensor)

    @torch.no_grad()
    def logprobs_of(self, tokens):
        logits = self.model(torch.tensor([tokens], device=self.device)).logits[0, :-1].float()
        targets = torch.tensor(tokens[1:], device=self.device)
        return logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0].tolist()

    def sleep(self):
        pass


class VLLMEngine:
    """Colocated vLLM: one in-process engine per torchrun rank (external launcher, TP 1).

    On GPU, with sleep_mode: asleep at level 2 while the trainer works (every sync re-pushes all
    weights, so none are backed up in host memory). Sleep mode means vLLM's CuMem allocator, of which a
    process may hold one instance: a second engine in the same process (eval's judge) has none.
    vLLM's CPU build has no sleep mode: sleep() does nothing, eager mode, and no chunked prefill
    (seeded requests fail under it on CPU); its bf16 is emulated and slower. For training it starts
    from dummy weights: the first sync writes the real ones.
    """

    def __init__(self, model, tok, max_model_len, gpu_memory_utilization, for_training=True, dtype=None,
                 sleep_mode=True):
        from vllm import LLM
        # the external launcher reads both
        os.environ.setdefault("RANK", str(dist.get_rank() if dist.is_initialized() else 0))
        os.environ.setdefault("LOCAL_RANK", "0")
        cuda = torch.cuda.is_available()
        self.dtype = dtype or compute_dtype("auto", torch.device("cuda" if cuda else "cpu"))
        self.can_sleep = cuda and sleep_mode
        self.logprobs = 0 if for_training else None  # the sampler's log-prob of each token: training only
        cpu_only = {} if cuda else {"enforce_eager": True, "enable_chunked_prefill": False}
        self.llm = LLM(model=model, distributed_executor_backend="external_launcher",
                       tensor_parallel_size=1, seed=0, dtype=str(self.dtype)[6:],
                       gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.can_sleep,
                       max_model_len=max_model_len, logprobs_mode="processed_logprobs",
                       load_format="dummy" if for_training else "auto",
                       cpu_distributed_timeout_seconds=7200, **cpu_only)  # vLLM's own groups: 2 h too
        self.cuda, self.asleep = cuda, False
        if for_training:  # its dummy weights wait for the first sync
            self.sleep()

    def generate(self, prompts, n, temperature, top_p, max_tokens, seeds, progress=False):
        """No allowed_token_ids: the trainer's log-probs are over the whole embedding, padded rows
        included, so the sampler must draw from that same distribution (and vLLM caps the list at 1,024)."""
        from vllm import SamplingParams
        if not prompts:
            return []
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=-1, max_tokens=max_tokens,
                                 logprobs=self.logprobs, seed=seed, detokenize=False) for seed in seeds]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=progress)
        return [[self._sample(c) for c in out.outputs] for out in outs]

    @staticmethod
    def _sample(c):
        """A vLLM completion as a Sample, with the sampler's log-prob of each of its tokens."""
        logprobs = c.logprobs and [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
        return Sample(list(c.token_ids), "length" if c.finish_reason == "length" else "stop", logprobs)

    @torch.no_grad()
    def load_weights(self, named_tensors):
        """Free the trainer's cached blocks, wake the weights, reload them in place, wake the KV cache, and
        drop the prefix cache: KV computed with the old weights must never be reused. The tensors come one
        at a time, ideally already in self.dtype on this device; `reload_weights` takes HF names, maps them
        onto vLLM's fused layers and re-runs the post-load processing of each layer that received a name
        (the CPU build's repacking too): a tied lm_head must come under its own name as well."""
        if self.cuda:
            torch.cuda.empty_cache()
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()
        self.asleep = False

    def logprobs_of(self, tokens):
        from vllm import SamplingParams
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        (out,) = self.llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
        return [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], tokens[1:])]

    def sleep(self):
        if self.can_sleep:
            self.llm.sleep(level=2)
            self.asleep = True


def sampler_logprobs(samples, valid):
    """[N, R] the sampler's log-prob of each sampled token (vLLM reports them), or None."""
    if samples[0].logprobs is None:
        return None
    out = torch.zeros(valid.shape, device=valid.device)
    out[valid] = torch.tensor([x for s in samples for x in s.logprobs], device=valid.device)
    return out


def make_engine(kind, model, tok, device, max_model_len, gpu_memory_utilization, for_training=True,
                dtype=None, sleep_mode=True):
    """--engine auto: vLLM when CUDA and vllm are present, else HF generate. dtype: the engine's
    weights (default: bf16 on CUDA, fp32 on CPU)."""
    dtype = dtype or compute_dtype("auto", device)
    if kind == "auto":
        kind = "vllm" if device.type == "cuda" and importlib.util.find_spec("vllm") else "hf"
    if kind == "vllm":
        return VLLMEngine(model, tok, max_model_len, gpu_memory_utilization, for_training, dtype, sleep_mode)
    return HFEngine(model, device, dtype, tok.eos_token_id)


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def compute_dtype(flag, device):
    """--dtype auto|bf16|fp32: the trainer's compute dtype and the engine's (auto: bf16 on CUDA)."""
    if flag == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[flag]
