"""The trainer's own passes at a published Qwen3 shape (random weights, no download): time, MFU, peak memory
and the padding of the micro-batches, on one device.

    python benchmarks/train_passes.py --shape 1.7b --samples 64 --prompt 256 --response 1024     # one GPU
    python benchmarks/train_passes.py --shape 1.7b --lengths lognormal --levers no_checkpointing,eager_layers
    python benchmarks/train_passes.py --lengths lognormal --padding-only        # the padding alone, no model
    python benchmarks/train_passes.py --shape 1.7b --phases update --reps 1 --profile update  # where it goes
    python benchmarks/train_passes.py --shape 1.7b --phases update,trl_update          # against TRL's update
    python benchmarks/train_passes.py --shape tiny --samples 16 --prompt 16 --response 48       # CPU, seconds

The model is a random Qwen3 of the shape (tiny: 2 layers of 64 for the tests; 0.6b, 1.7b, 4b tied; 8b untied;
V 151,936 but for tiny's 512), saved to a temporary folder and read back by the project's own
policy.build_policy (FSDP2 on a world of one: fp32 master weights, the compute dtype bf16 on CUDA and fp32 on
CPU, activation checkpointing), with AdamW, all as stapo.py builds them (AdamW fused on CUDA, foreach on CPU).
Its decoder layers are compiled as stapo.py's --compile-layers says (--compile-layers: auto compiles them on
CUDA, layers.should_compile), by layers.compile_layers with --layers-compiler (inductor, as stapo.py; build_policy
makes the same call last). The batch is one mini-batch of --samples rows of random token ids, advantages from
random +-1 rewards in groups of 8.
Phases, each timed after one warm-up run (the median of --reps; the warm-up's time, compiles included, is
printed as warmup_s). The project's phases are timed by the trainer's own clock, metrics.StepMetrics (each
phase's seconds, the device synchronised at its end; its split, seconds_by_phase, is printed too):
  old_pass       policy.token_stats over the mini-batch, no grad (stapo.py's step 4: the old log p and H)
  update         stapo.update: every micro-batch's forward and backward, the loss, the clip, AdamW's step
  full_logits    the same update, the same model, batch and loss, with the policy's head replaced by full
                 logits: h @ W.T (compute dtype) -> fp32 log_softmax -> gather (no entropy): the reference
                 update of a trainer without a fused head
  trl_update     (asked for by name; equal lengths only) TRL 1.16's own loss path on the same checkpoint and
                 rows: its GRPOTrainer as its user runs it by default (fp32 weights, bf16 autocast on CUDA,
                 gradient checkpointing, eager layers, its fused LM head, transformers' AdamW), loss_type
                 dapo with clip-higher 0.2/0.28 and beta 0 (STAPO's loss without S2T), its compute_loss and
                 the accelerator's backward on micro-batches of as many samples as the longest fits in
                 --micro-tokens (its batch size counts samples), in their order, prompts left-padded and
                 completions right-padded, then the clip and the optimizer's step; never its generation.
                 Its peak is above what this script's own policy held before TRL's trainer was built.
                 Needs trl (and accelerate) importable
Lengths (--lengths, a comma list, one model built for all): equal (every prompt --prompt, every response
--response tokens); lognormal (responses log-normal, median --response, sigma --sigma, clipped to 200..8,192,
seeded by --seed); or a file (one response length a line, or JSON lines with a response_len, length or tokens
field), cycled to --samples.

MFU = model FLOPs / time / (peak TFLOP/s of the device). Model FLOPs of one forward, over the real tokens only
(padding is waste, not work): 2 x (the decoder layers' matmul parameters) per token, plus causal attention,
2 x 2 x layers x heads x head_dim x seq^2 / 2 per sample (QK^T and AV), plus the head, 2 x V x hidden per
response token (the head runs on response tokens only); x3 for a training pass (forward and backward);
activation recomputation is not counted. Peak TFLOP/s: --peak-tflops, else by the device's name (H100, H200:
989, dense bf16, SXM); none on CPU (MFU printed as null).
Padded fraction: of the tokens the decoder computes (each micro-batch padded to its longest sample), the share
that is padding, in the micro-batches the passes run (policy.micro_batches at --micro-tokens), and, printed
for every batch, for both cuts (the trainer's, and the fewest micro-batches that fit).
Host syncs (CUDA only, null on CPU): the calls of the last timed run that made the host wait for the device,
counted by torch.cuda.set_sync_debug_mode("warn"): a fixed few per update (the statistics, the norms) and none
per micro-batch is the aim (tests/test_policy.py counts the micro-batch loops' on CPU).
Layers: each line of a phase says how its decoder layers ran (layers: compiled or eager, as Policy.layers says)
and the layer calls of its timed runs that ran eager (eager_layer_calls: the difference of
Policy.layers.eager_calls; every call when eager, none when every call ran compiled). A line whose layers are
compiled but whose calls ran eager (a graph that failed to compile, or dynamo's recompile limit) says so
(ran_eager_although_compiled, and its table row marks it): it is no figure of compiled layers.
Levers (--levers, a comma list; a+b applies both): after the base runs, each is turned on alone (this
process only), the phases other than full_logits run again on the first --lengths, and it is turned off
again, so each lever is measured against the base on the same model and batch:
  micro_tokens_x2, micro_tokens_x4   2 or 4 x --micro-tokens (fewer, larger micro-batches)
  no_checkpointing  activation checkpointing off (stapo.py --checkpointing off: Policy.layers' checkpointing)
  selective_checkpointing  the matmuls' and attention's outputs kept, the rest recomputed (--checkpointing
                    selective)
  compile_layers    each decoder layer compiled (layers.compile_layers; the base's choice on CUDA, as
                    stapo.py's --compile-layers auto), its compile in the warm-up run
  eager_layers      each decoder layer eager (the base's choice on CPU)
The trainer's cut against the fewest micro-batches that fit is printed for every batch as arithmetic (the padding
lines); its time is not measured: stapo.update cuts its micro-batches itself, at policy.MICRO_BATCH_COST.
Profile (--profile, a comma list of phases): after a phase's timed line, one more run of it under
torch.profiler: one JSON line (its wall time, which the profiler's own host work lengthens; on CUDA, the
kernels' summed time and its share of the timed run's seconds, which says whether the device waited on the
host; that time by kind: attention, matmul, compiled (Triton), optimizer, collectives, copies, other) and the
profiler's table of the operators with the most time of their own (device time on CUDA, CPU time on CPU), for
the base and for each lever.
Every phase prints one JSON line; a table and the ratios (of this one run) close the output. All of it is
also written to a results file (--results: record.py).
"""
import argparse, gc, json, math, os, shutil, statistics, sys, tempfile, time, types, warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # record.py

SHAPES = {  # Qwen3's published configs (Hugging Face config.json of each Base model)
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense bf16, SXM datasheets
SHORTEST, LONGEST = 200, 8192  # the log-normal's clip


# ---- the model, the lengths, the batch ------------------------------------------------------------

def save_random_model(folder, shape, device):
    """A Qwen3 of `shape` with random weights (transformers' own init), saved to `folder` (bf16 for the
    published shapes, fp32 for tiny), its config.json last: a run killed while saving leaves no folder that
    a later --model-dir would take for a checkpoint. Returns the config."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(max_position_embeddings=40960, rope_theta=1e6, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    os.makedirs(folder, exist_ok=True)
    part = tempfile.mkdtemp(dir=folder)
    model.to(torch.float32 if shape == "tiny" else torch.bfloat16).save_pretrained(part)
    for name in sorted(os.listdir(part), key=lambda n: n == "config.json"):
        os.replace(os.path.join(part, name), os.path.join(folder, name))
    os.rmdir(part)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return cfg


def response_lengths(kind, n, median, sigma, seed):
    """n response lengths: equal, log-normal (median, sigma, clipped to 200..8,192, seeded) or read from a
    file (one a line, or JSON lines with response_len, length or tokens), cycled to n."""
    if kind == "equal":
        return [median] * n
    if kind == "lognormal":
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, generator=g, dtype=torch.float64) * sigma + math.log(median)
        return [min(LONGEST, max(SHORTEST, round(math.exp(v)))) for v in x.tolist()]
    found = []
    for line in open(kind):
        line = line.strip()
        if not line:
            continue
        if line[0] != "{":
            found.append(int(float(line)))
            continue
        row = json.loads(line)
        value = next(row[k] for k in ("response_len", "length", "tokens") if k in row)
        found.append(len(value) if isinstance(value, list) else int(value))
    return [found[i % len(found)] for i in range(n)]


def make_rows(n, prompt, lengths, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(vocab, (prompt,), generator=g).tolist(),
             torch.randint(vocab, (r,), generator=g).tolist()) for r in lengths]


# ---- padding ---------------------------------------------------------------------------------------

def padding(rows, groups):
    """(padded fraction of the tokens computed, tokens computed): each micro-batch padded to its longest."""
    from policy import length
    real = computed = 0
    for g in groups:
        if g:
            lengths = [length(rows[i]) for i in g]
            real, computed = real + sum(lengths), computed + max(lengths) * len(g)
    return (1 - real / computed if computed else 0.0), computed


# ---- levers: one speed choice each, on or off in this process --------------------------------------

LEVERS = ("micro_tokens_x2", "micro_tokens_x4", "no_checkpointing", "selective_checkpointing", "compile_layers",
          "eager_layers")
FEWEST = 1e6  # a micro-batch's cost, in --micro-tokens, that outweighs any padding: the fewest that fit


def set_layers(policy, compiled, compiler):
    """The policy's decoder layers compiled by `compiler` (layers.compile_layers), or eager (layers.eager_layers)."""
    import layers
    if compiled:
        layers.compile_layers(policy.lm, policy.layers, compiler)
    else:
        layers.eager_layers(policy.lm, policy.layers)


def set_lever(policy, lever, on, base):
    """Turn one of LEVERS on, or off again: back to the base, whose layers are compiled if base["compiled"] (by
    base["compiler"]) and checkpointed fully (micro_tokens_xN is run_passes' --micro-tokens, nothing to set)."""
    if lever in ("no_checkpointing", "selective_checkpointing"):
        policy.layers.checkpointing = {"no_checkpointing": "off"}.get(lever, "selective") if on else "full"
    elif lever in ("compile_layers", "eager_layers"):
        set_layers(policy, (lever == "compile_layers") if on else base["compiled"], base["compiler"])


def layers_line(policy, eager_calls):
    """How a phase's decoder layers ran: compiled or eager, its timed runs' eager layer calls, and whether they
    ran eager although compiled (then the line is no figure of compiled layers)."""
    compiled = policy.layers.compiled
    return {"layers": "compiled" if compiled else "eager", "eager_layer_calls": eager_calls,
            "ran_eager_although_compiled": bool(compiled and eager_calls),
            "layer_compile_failures": len(policy.layers.failures)}


# ---- FLOPs and memory ------------------------------------------------------------------------------

def forward_flops(cfg, rows):
    """Model FLOPs of one forward over the real tokens of rows (see the docstring)."""
    d, layers, f = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    per_token = 2 * layers * (d * hq * hd + 2 * d * hkv * hd + hq * hd * d + 3 * d * f)  # q, k, v, o, MLP
    total = 0
    for p, r in rows:
        seq = len(p) + len(r)
        total += per_token * seq + 4 * layers * hq * hd * seq * seq / 2 + 2 * cfg.vocab_size * d * len(r)
    return total


def reset_peak(cuda):
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the resident set's high-water mark starts again from now


def peak_gib(cuda, now=False):
    """The peak since reset_peak (now: what is held at this moment), GiB: allocated on CUDA, the resident set
    on CPU."""
    if cuda:
        return (torch.cuda.memory_allocated() if now else torch.cuda.max_memory_allocated()) / 2**30
    field = "VmRSS:" if now else "VmHWM:"
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 2**20


# ---- the trainer's calls: each in one place, so a rename is a one-line change ----------------------

def counting_syncs(fn, cuda):
    """(fn(), how many of its CUDA calls waited for the device: torch's sync debug mode), None on CPU."""
    if not cuda:
        return fn(), None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, sum("synchronizing CUDA operation" in str(w.message) for w in seen)


def old_pass(P, policy, rows, idx, valid, micro_tokens, temperature):
    """Step 4: the old policy's log p (and H) of the mini-batch, no grad. Returns [n, R] log p."""
    return P.token_stats(policy, rows, idx, valid, micro_tokens, temperature).logp


def run_update(S, policy, opt, batch, idx, old_logp, args, tally):
    """stapo.update on mini-batch idx, every token kept (each token's scale 1: nothing silenced)."""
    valid = batch.valid[idx]
    mb = S.MiniBatch(idx=idx, old_logp=old_logp, adv=batch.adv[idx], scale=valid.float(),
                     num_tokens=float(valid.sum()))
    return S.update(policy, opt, batch.rows, batch.valid, mb, args, tally)


def full_logits_head(hidden, weight, tokens, temperature, chunk_size=None, collision=False):
    """In place of head.ChunkedHead.apply: full logits -> fp32 log_softmax -> gather (no entropy)."""
    logp = torch.log_softmax((hidden @ weight.T).float() / temperature, -1).gather(-1, tokens[:, None])
    zeros = torch.zeros(len(logp) if collision else 0, device=logp.device)
    return logp[:, 0].clone(), torch.zeros(len(logp), device=logp.device), zeros  # no views: FSDP2 warns


# ---- TRL's own update (trl_update) -------------------------------------------------------------------

_TRL = {}  # folder -> TRL's GRPOTrainer on it: built by a trl_update phase's first run, dropped at its end


def preload_trl():
    """TRL's trainer classes imported before any trainer exists: the import leaves its frames alive (TRL
    1.16's lazy module keeps a reference), and a frame that went on to hold a trainer would keep it, its
    weights and its optimizer, to the end of the run. A failed import is trl_update's to report."""
    try:
        from datasets import Dataset  # noqa: F401
        from trl import GRPOConfig, GRPOTrainer  # noqa: F401
    except Exception:
        pass


def trl_trainer(folder, cuda):
    """TRL 1.16's GRPOTrainer on folder's checkpoint, as its user runs it by default (see trl_update in the
    docstring): built once, its optimizer created and gradient checkpointing on, as its train() would."""
    if folder not in _TRL:
        from datasets import Dataset
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast
        from trl import GRPOConfig, GRPOTrainer
        words = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1}, unk_token="<pad>"))  # never tokenizes
        tok = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>")
        config = GRPOConfig(output_dir=os.path.join(folder, "trl"), per_device_train_batch_size=8,
                            num_generations=8, loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28,
                            learning_rate=1e-6, weight_decay=0.1, max_grad_norm=1.0, bf16=cuda,
                            use_cpu=not cuda, gradient_checkpointing=True, report_to="none",
                            save_strategy="no", disable_tqdm=True)
        reward = lambda completions, **_: [0.0] * len(completions)  # noqa: E731 (never called)
        data = Dataset.from_list([{"prompt": "x"}] * 8)  # nor is it: no generation runs
        trainer = GRPOTrainer(model=folder, reward_funcs=reward, args=config, train_dataset=data,
                              processing_class=tok)
        trainer.create_optimizer()
        trainer.model.gradient_checkpointing_enable(config.gradient_checkpointing_kwargs)
        trainer.model.train()
        _TRL[folder] = trainer
    return _TRL[folder]


def trl_padding(rows, parts):
    """(padded fraction, tokens computed) of TRL's micro-batches: prompts left-padded to the longest prompt,
    completions right-padded to the longest completion, each apart."""
    real = sum(len(p) + len(c) for p, c in rows)
    computed = sum(len(part) * (max(len(rows[i][0]) for i in part) + max(len(rows[i][1]) for i in part))
                   for part in parts)
    return 1 - real / computed, computed


def trl_update(trainer, rows, adv, parts):
    """One optimizer step of TRL's own loss path over rows, a micro-batch per part: compute_loss and the
    accelerator's backward each, then the clip and the step, as its training loop runs them."""
    model, acc, pad = trainer.model, trainer.accelerator, trainer.processing_class.pad_token_id
    trainer.current_gradient_accumulation_steps = len(parts)  # what its loop sets
    items = torch.tensor(float(sum(len(c) for _, c in rows)), device=acc.device)  # dapo: the batch's tokens
    tensor = lambda x: torch.tensor(x, device=acc.device)  # noqa: E731
    for part in parts:
        prompts, completions = [rows[i][0] for i in part], [rows[i][1] for i in part]
        P, C = max(map(len, prompts)), max(map(len, completions))
        inputs = dict(prompt_ids=tensor([[pad] * (P - len(p)) + p for p in prompts]),
                      prompt_mask=tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts]),
                      completion_ids=tensor([c + [pad] * (C - len(c)) for c in completions]),
                      completion_mask=tensor([[1] * len(c) + [0] * (C - len(c)) for c in completions]),
                      advantages=adv[part].to(acc.device), num_items_in_batch=items)
        acc.backward(trainer.compute_loss(model, inputs))
    acc.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


# ---- the run ---------------------------------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="1.7b", choices=sorted(SHAPES), help="a published Qwen3 shape")
    p.add_argument("--samples", type=int, default=64, help="rows of the mini-batch (per rank)")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens of every sample")
    p.add_argument("--response", type=int, default=1024, help="response tokens (lognormal: the median)")
    p.add_argument("--lengths", default="equal", help="comma list of: equal, lognormal, a file of lengths")
    p.add_argument("--sigma", type=float, default=1.0, help="the log-normal's sigma")
    p.add_argument("--seed", type=int, default=0, help="the lengths' and the token ids' seed")
    p.add_argument("--micro-tokens", type=int, default=16384, help="stapo.py's --micro-tokens")
    p.add_argument("--reps", type=int, default=2, help="timed runs of each phase, after one warm-up")
    p.add_argument("--phases", default="old_pass,update,full_logits", help="comma list of the phases timed")
    p.add_argument("--compile-layers", default="auto", choices=["auto", "on", "off"],
                   help="the base's decoder layers, as stapo.py's flag (auto: compiled on CUDA)")
    p.add_argument("--layers-compiler", default="inductor",
                   help="the dynamo backend that compiles the layers (default inductor, as stapo.py)")
    p.add_argument("--peak-tflops", type=float, help="the device's peak (default: by its name; none on CPU)")
    p.add_argument("--model-dir", help="a folder saved by an earlier run (default: a new temporary one)")
    p.add_argument("--padding-only", action="store_true", help="print the padded fractions, run nothing")
    p.add_argument("--levers", default="", help="comma list of levers, each measured alone against the base "
                   f"(a+b: both): {', '.join(LEVERS)}")
    p.add_argument("--profile", default="", help="comma list of phases profiled once after their timed runs")
    import record
    record.add_flag(p)
    a = p.parse_args(argv)
    for lever in filter(None, a.levers.replace("+", ",").split(",")):
        if lever not in LEVERS:
            p.error(f"--levers: unknown lever {lever!r} (known: {', '.join(LEVERS)})")
    vocab = SHAPES[a.shape]["vocab_size"]
    from policy import shortest_first
    batches = []
    for kind in a.lengths.split(","):
        rows = make_rows(a.samples, a.prompt, response_lengths(kind, a.samples, a.response, a.sigma, a.seed),
                         vocab, a.seed + 1)
        name = kind if kind in ("equal", "lognormal") else "file"
        batches.append((name, rows, shortest_first(rows, range(a.samples))))  # as split_minibatches sorts
    with record.kept(a.results, "train_passes"):
        if a.padding_only:
            for name, rows, idx in batches:
                print_padding(rows, idx, a, name)
            return {}
        folder = a.model_dir or tempfile.mkdtemp(prefix="train_passes_")
        try:
            return run_all(a, batches, folder)
        finally:
            if not a.model_dir:
                shutil.rmtree(folder, ignore_errors=True)


def run_all(a, batches, folder):
    """Build the policy from a random checkpoint of --shape in folder, then every phase on every batch, then
    the levers on the first: returns each phase's line by (lengths, lever)."""
    vocab = SHAPES[a.shape]["vocab_size"]
    import head, layers, parallel, policy as P, stapo as S
    rank, world, device, mesh = parallel.init_distributed()
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = a.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.perf_counter()
    if not os.path.exists(os.path.join(folder, "config.json")):
        save_random_model(folder, a.shape, device)
    base = dict(compiled=layers.should_compile(a.compile_layers, device), compiler=a.layers_compiler)
    if "trl_update" in a.phases.split(","):
        preload_trl()
    policy = P.build_policy(folder, mesh, device, dtype)
    set_layers(policy, base["compiled"], base["compiler"])  # what build_policy(..., compiled=True) does last
    opt = P.build_optimizer(policy, 1e-6, 0.1)  # stapo.py's, at its default lr and weight decay
    params = sum(t.numel() for t in policy.parameters())
    print(json.dumps({"phase": "build", "shape": a.shape, "params": params, "device": name,
                      "dtype": str(dtype)[6:], "torch": torch.__version__,
                      "seconds": round(time.perf_counter() - t0, 1),
                      "head_chunk_rows_auto": head.chunk_rows(device, vocab),
                      "head_compiled": head.compiles(device), "layers_compiled": base["compiled"],
                      "layers_compiler": base["compiler"] if base["compiled"] else None, "peak_tflops": peak,
                      "samples": a.samples, "micro_tokens": a.micro_tokens}), flush=True)
    results = {}
    for dist_name, rows, idx in batches:
        print_padding(rows, idx, a, dist_name)
        results[(dist_name, None)] = run_passes(P, S, policy, opt, rows, idx, a, device, peak, dist_name,
                                               folder)
        print_table(results[(dist_name, None)], a, name, peak, dist_name)
    dist_name, rows, idx = batches[0]
    phases = ",".join(x for x in a.phases.split(",") if x not in ("full_logits", "trl_update"))  # no lever's
    for combo in filter(None, a.levers.split(",")):
        levers = combo.split("+")
        times = math.prod(int(x.rsplit("_x", 1)[1]) for x in levers if x.startswith("micro_tokens_x"))
        b = argparse.Namespace(**{**vars(a), "phases": phases, "micro_tokens": a.micro_tokens * times})
        for lever in levers:
            set_lever(policy, lever, True, base)
        try:
            config = run_passes(P, S, policy, opt, rows, idx, b, device, peak, dist_name, folder,
                                lever=combo)
        finally:
            for lever in levers:
                set_lever(policy, lever, False, base)
        results[(dist_name, combo)] = config
        print_table(config, b, name, peak, dist_name, combo)
    return results


def run_passes(P, S, policy, opt, rows, idx, a, device, peak, dist_name, folder, lever=None):
    """Each phase of --phases on one batch (with `lever` on, if given), in the micro-batches the trainer cuts:
    one JSON line each (trl_update builds TRL's trainer on folder's checkpoint); returns them by phase."""
    import head
    from metrics import StepMetrics
    from stapo_core import group_advantages
    cuda = device.type == "cuda"
    groups = [idx[part] for part, idle in P.micro_batches(rows, idx, a.micro_tokens) if not idle]
    pad_ours, computed_ours = padding(rows, groups)
    prompts = [(k // 8, r[0], None) for k, r in enumerate(rows[::8])]
    sample = lambda r: types.SimpleNamespace(tokens=r[1], logprobs=None, finish_reason="stop")  # noqa: E731
    samples = [[sample(r) for r in rows[k:k + 8]] for k in range(0, len(rows), 8)]
    rewards = torch.randint(2, (len(rows),), generator=torch.Generator().manual_seed(a.seed + 2)) * 2.0 - 1
    batch = S.make_batch(prompts, samples, group_advantages(rewards, min(8, len(rows))), device)
    args = S.get_args(["--micro-tokens", str(a.micro_tokens)])
    fwd, tokens = forward_flops(policy.lm.config, rows), sum(len(x) + len(y) for x, y in rows)
    state, results = {}, {}

    def old():  # timed as stapo.py's step times it: from the tally's start to its old_policy mark
        tally = StepMetrics(0, "stapo")
        state["old"] = old_pass(P, policy, batch.rows, idx, batch.valid, a.micro_tokens, args.temperature)
        tally.peak("old_policy")
        return tally

    def update():  # stapo.update marks its own phases: backward (the micro-batches), optimizer
        tally = StepMetrics(0, "stapo")
        run_update(S, policy, opt, batch, idx, state["old"], args, tally)
        return tally

    def full_logits():
        P.ChunkedHead = types.SimpleNamespace(apply=full_logits_head)  # policy's name for the head
        try:
            return update()
        finally:
            P.ChunkedHead = head.ChunkedHead

    per = max(1, a.micro_tokens // max(len(x) + len(y) for x, y in rows))  # TRL's samples per micro-batch
    trl_parts = [list(range(i, min(i + per, len(rows)))) for i in range(0, len(rows), per)]
    cut = {"trl_update": (*trl_padding(rows, trl_parts), len(trl_parts))}  # else (padded, computed, count)

    def trl():
        trainer = trl_trainer(folder, cuda)
        trl_update(trainer, rows, batch.adv, trl_parts)

    phases = {"old_pass": (old, fwd), "update": (update, 3 * fwd), "full_logits": (full_logits, 3 * fwd),
              "trl_update": (trl, 3 * fwd)}
    old()  # the update's old log p, whichever phases run
    for phase in a.phases.split(","):
        if phase == "trl_update" and dist_name != "equal":
            continue  # TRL's micro-batches count samples: sized for the longest, a long tail runs one by one
        fn, flops = phases[phase]
        held = peak_gib(cuda, now=True) if phase == "trl_update" else 0.0  # ours, before TRL's is built
        times, peaks, split, syncs, warmup, eager = [], [], [], None, None, 0
        for r in range(a.reps + 1):
            reset_peak(cuda)
            eager_from = policy.layers.eager_calls
            t = time.perf_counter()
            try:
                tally, counted = counting_syncs(fn, cuda) if r else (fn(), None)
            except torch.OutOfMemoryError as e:
                print_error(e, phase=phase, lengths=dist_name, lever=lever, error="OOM")
                torch.cuda.empty_cache()
                break
            except Exception as e:  # TRL missing or changed: its line says so, the rest still prints
                if phase != "trl_update":
                    raise
                print_error(e, phase=phase, lengths=dist_name, lever=lever)
                break
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t  # TRL's phase: this script's clock; the project's: the trainer's
            if tally is not None:
                seconds = sum(tally.seconds.values())
            peaks.append(max([peak_gib(cuda)] + list(tally.peaks.values() if tally else [])) - held)
            if r:  # the first is the warm-up (compiles, allocator growth)
                times.append(seconds)
                split.append(tally.seconds if tally else {})
                syncs = counted
                eager += policy.layers.eager_calls - eager_from
            else:
                warmup = seconds
        if times:
            s = statistics.median(times)
            tflops = flops / s / 1e12
            pad, computed, count = cut.get(phase, (pad_ours, computed_ours, len(groups)))
            by_phase = split[times.index(sorted(times)[(len(times) - 1) // 2])]  # the median run's (lower middle)
            out = {"phase": phase, "lengths": dist_name, "lever": lever,
                   "seconds": round(s, 4), "seconds_by_phase": {k: round(v, 4) for k, v in by_phase.items()},
                   "times": [round(x, 4) for x in times], "warmup_s": round(warmup, 2),
                   "tokens_per_s": round(tokens / s),
                   "tflops": round(tflops, 2), "mfu": round(tflops / peak, 4) if peak else None,
                   "peak_gib": round(max(peaks), 3), "padded_frac": round(pad, 4), "micro_batches": count,
                   "tokens": tokens, "tokens_computed": computed, "host_syncs": syncs,
                   **(layers_line(policy, eager) if phase != "trl_update" else
                      {"layers": "trl", "eager_layer_calls": None, "ran_eager_although_compiled": False})}
            results[phase] = out
            print(json.dumps(out), flush=True)
            if phase in a.profile.split(","):
                try:
                    profile(fn, cuda, phase, dist_name, lever, s)
                except Exception as e:  # the profiler on this device: its line says why, the rest still runs
                    print_error(e, phase="profile", of=phase, lengths=dist_name, lever=lever)
        if phase == "trl_update":  # TRL's weights and optimizer off the device: no later row counts them
            _TRL.pop(folder, None)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    return results


def print_error(e, error=None, **where):
    """The JSON line of a run that failed: where (phase, lengths, lever), the error's name, what it said."""
    print(json.dumps({**where, "error": error or type(e).__name__, "detail": str(e)[:300]}), flush=True)


KINDS = (  # the profile's kinds of time, by the kernel's or operator's name (the first that matches)
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm")),
    ("compiled", ("triton", "compiledfunction", "inductor")),
    ("optimizer", ("adam",)),
    ("collectives", ("nccl", "all_gather", "reduce_scatter", "allreduce", "all_reduce")),
    ("copies", ("memcpy", "memset", "copy", "cat", "fill", "zero")),
)


def profile(fn, cuda, phase, dist_name, lever, timed, rows=15):
    """One more run of fn under torch.profiler: a JSON line (its wall time, which the profiler's own host
    work lengthens; on CUDA the kernels' summed time, and its share of the timed run's `timed` seconds,
    device_busy: well under 1, the device waited on the host; that time by kind of kernel, KINDS, the rest
    "other") and the operators with the most time of their own. On CPU the kinds sum the operators' own
    CPU time."""
    from torch.profiler import ProfilerActivity, profile as profiler
    with profiler(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    events, kernels = prof.key_averages(), None
    own = [(e.key, e.self_cpu_time_total) for e in events]  # each operator's own time
    if cuda:  # the kernels' own time, as the table's "Self CUDA time total" sums it
        gpu = torch.autograd.DeviceType.CUDA
        own = [(e.key, e.self_device_time_total) for e in events
               if e.device_type == gpu and not getattr(e, "is_user_annotation", False)]
        kernels = sum(t for _, t in own) / 1e6
    kinds = dict.fromkeys([k for k, _ in KINDS] + ["other"], 0.0)
    for name, t in own:
        kind = next((k for k, words in KINDS if any(w in name.lower() for w in words)), "other")
        kinds[kind] += t / 1e6
    print(json.dumps({"phase": "profile", "of": phase, "lengths": dist_name, "lever": lever,
                      "wall_s": round(wall, 4),
                      "kernels_s": None if kernels is None else round(kernels, 4),
                      "device_busy": None if kernels is None else round(kernels / timed, 3),
                      "by_kind_s": {k: round(v, 4) for k, v in kinds.items()}}), flush=True)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(events.table(sort_by=key, row_limit=rows, max_name_column_width=60), flush=True)


def print_padding(rows, idx, a, dist_name):
    """The padded fraction of two cuts at --micro-tokens (policy.cut_by_length, as one rank cuts): the
    trainer's, and the fewest micro-batches that fit. Pure arithmetic."""
    from policy import MICRO_BATCH_COST, cut_by_length, length
    lengths = [length(rows[i]) for i in idx]
    for label, cost in (("trainers_cut", MICRO_BATCH_COST), ("fewest_micro_batches", FEWEST)):
        groups = [idx[part] for part in cut_by_length(lengths, a.micro_tokens, cost)]
        pad, computed = padding(rows, groups)
        print(json.dumps({"phase": "padding", "lengths": dist_name, "grouping": label,
                          "micro_tokens": a.micro_tokens, "micro_batches": len(groups),
                          "padded_frac": round(pad, 4), "tokens_computed": computed,
                          "tokens": sum(len(x) + len(y) for x, y in rows)}), flush=True)


def layers_cell(r):
    """A row's layers, as the table prints them: compiled, eager, or EAGER where compiled layers ran eager."""
    if r["ran_eager_although_compiled"]:
        return f"**EAGER**: compiled, but {r['eager_layer_calls']} calls ran eager"
    return r["layers"] if r["eager_layer_calls"] is None else f"{r['layers']}, {r['eager_layer_calls']} eager"


def print_table(results, a, name, peak, dist_name, lever=None):
    """The phases of one configuration, one row each; ratios of this one run. A ratio of a phase whose compiled
    layers ran eager says so."""
    which = f"lever {lever}" if lever else "base"
    print(f"\n{a.shape}, {a.samples} samples, lengths {dist_name}, {which}, --micro-tokens {a.micro_tokens}, "
          f"on {name}; MFU against {peak or 'no'} TFLOP/s (model FLOPs: 2N per token, the "
          "head on response tokens, causal attention, x3 to train, recomputation not counted)")
    print("| phase | s | tokens/s | TFLOP/s | MFU | peak GiB | padded | layers, eager calls |\n"
          "|---|---|---|---|---|---|---|---|")
    for phase, r in results.items():
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        print(f"| {phase} | {r['seconds']:.3f} | {r['tokens_per_s']} | {r['tflops']:.1f} | {mfu} | "
              f"{r['peak_gib']:.2f} | {100 * r['padded_frac']:.1f}% | {layers_cell(r)} |")
    for x, y in (("update", "full_logits"), ("update", "old_pass")):
        if x in results and y in results:
            u, f = results[x], results[y]
            memory = f"{u['peak_gib'] / f['peak_gib']:.2f}x" if f["peak_gib"] else "n/a"  # a tiny pass can peak at 0
            eager = " (layers ran eager although compiled)" if (
                u["ran_eager_although_compiled"] or f["ran_eager_although_compiled"]) else ""
            print(f"{x} / {y}: time {u['seconds'] / f['seconds']:.2f}x, peak memory {memory} (one run){eager}")


if __name__ == "__main__":
    main()
