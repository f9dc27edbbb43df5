"""eval.py: the paper's six math benchmarks, avg@k with its protocol, for any checkpoint.

    python eval.py --model PATH_OR_HUB_ID [--preset train|justrl] [--benchmarks all] [--limit N]
    torchrun --nproc_per_node 8 eval.py --model ...       # the problems are sharded over ranks
    python eval.py --compare runs/eval_a runs/eval_b      # two results side by side

k samples per problem (32 for AIME24/25 and AMC23, 4 for the others), each problem seeded; avg@k is the
mean accuracy over the k samples, pass@k the fraction of problems with a correct sample. "Correct" is
reward.score > 0 on the last \\boxed{}: gold conventions (AIME's zero padding, Minerva's e-notation,
OlympiadBench's unordered multi-answers) live in reward.py, not here.
"""
import argparse, functools, json, os, time

# name: (Hub id, split, problem column, answer column, samples per problem)
BENCHMARKS = {
    "aime24": ("math-ai/aime24", "test", "problem", "solution", 32),  # no answer column: the boxed solution
    "aime25": ("math-ai/aime25", "test", "problem", "answer", 32),
    "amc23": ("math-ai/amc23", "test", "question", "answer", 32),
    "math500": ("HuggingFaceH4/MATH-500", "test", "problem", "answer", 4),
    "minerva": ("math-ai/minervamath", "test", "question", "answer", 4),
    "olympiadbench": ("math-ai/olympiadbench", "test", "question", "final_answer", 4),
}
PRESETS = {"train": (1.0, 1.0), "justrl": (0.7, 0.9)}  # (temperature, top-p): the paper's two settings


def hub_row(name, row, i):
    """One Hub row mapped to {id, problem, answer}."""
    from reward import extract_boxed
    _, _, pcol, acol, _ = BENCHMARKS[name]
    answer = row[acol]
    if name == "aime24":
        answer = extract_boxed(answer) or answer
    elif isinstance(answer, list):  # OlympiadBench: final_answer is a list of strings
        answer = ", ".join(a.strip("$") for a in answer)
    elif isinstance(answer, float):  # AMC23 stores 27.0
        answer = str(int(answer)) if answer.is_integer() else str(answer)
    return {"id": str(row.get("id", row.get("unique_id", i))), "problem": row[pcol], "answer": str(answer)}


@functools.lru_cache(maxsize=None)  # --eval-every reads each benchmark once per run, not once per evaluation
def load_benchmark(name, data_dir=None, source=None):
    """{id, problem, answer} rows: <data_dir>/<name>.jsonl if given, else the Hub (or `source`, a local
    .parquet/.jsonl in the Hub's layout)."""
    from rollout import read_jsonl
    if data_dir:
        return [{"id": str(r.get("id", w)), "problem": r["problem"], "answer": str(r["answer"])}
                for w, r in read_jsonl(os.path.join(data_dir, name + ".jsonl"), ["problem", "answer"])]
    import datasets
    hub, split = BENCHMARKS[name][:2]
    ds = datasets.load_dataset(hub, split=split) if source is None else datasets.load_dataset(
        "parquet" if source.endswith(".parquet") else "json", data_files=source, split="train")
    return [hub_row(name, r, i) for i, r in enumerate(ds)]


def summarize(records):
    """One row per benchmark from per-sample records, plus the mean of avg@k over the benchmarks."""
    rows = {}
    for name in dict.fromkeys(r["benchmark"] for r in records):
        rs = [r for r in records if r["benchmark"] == name]
        by_problem = {}
        for r in rs:
            by_problem.setdefault(r["id"], []).append(r["correct"])
        rows[name] = {"n": len(by_problem), "k": max(map(len, by_problem.values())),
                      "avg@k": 100 * sum(sum(c) / len(c) for c in by_problem.values()) / len(by_problem),
                      "pass@k": 100 * sum(any(c) for c in by_problem.values()) / len(by_problem),
                      "mean_len": sum(r["length"] for r in rs) / len(rs),
                      "truncated": sum(r["finish_reason"] == "length" for r in rs) / len(rs)}
    if rows:
        rows["average"] = {"avg@k": sum(r["avg@k"] for r in rows.values()) / len(rows)}
    return rows


def table(rows):
    head = "| benchmark | n | k | avg@k (%) | pass@k (%) | mean length | truncated |\n|---|---|---|---|---|---|---|"
    return "\n".join([head] + [f"| **average** | | | **{r['avg@k']:.2f}** | | | |" if n == "average" else
                                f"| {n} | {r['n']} | {r['k']} | {r['avg@k']:.2f} | {r['pass@k']:.2f} | "
                                f"{r['mean_len']:.0f} | {r['truncated']:.3f} |" for n, r in rows.items()])


def evaluate(engine, tok, names, samples, temperature, top_p, max_tokens, rank=0, world=1, data_dir=None,
             limit=None, chat_template=True, enable_thinking=False, seed=0):
    """Per-sample records for this rank's share of each benchmark (problem i goes to rank i % world).
    Each benchmark's prompts go to the engine in one call; the answers are checked on parallel threads."""
    from reward import extract_boxed, score_all
    from rollout import encode_prompt, seed_of
    records = []
    for name in names:
        every = load_benchmark(name, data_dir)[:limit]
        problems, k = every[rank::world], samples or BENCHMARKS[name][4]
        outs = engine.generate([encode_prompt(tok, p["problem"], chat_template, enable_thinking) for p in problems],
                               k, temperature, top_p, max_tokens, progress=rank == 0,
                               seeds=[seed_of(seed, i) for i in range(rank, len(every), world)])
        texts = [tok.decode(s.tokens, skip_special_tokens=True) for out in outs for s in out]
        golds = [p["answer"] for p in problems for _ in range(k)]
        for j, (text, gold, s) in enumerate(zip(texts, golds, score_all(texts, golds))):
            sample = outs[j // k][j % k]
            records.append({"benchmark": name, "id": problems[j // k]["id"], "sample": j % k,
                            "problem": problems[j // k]["problem"], "completion": text,
                            "extracted": extract_boxed(text), "gold": gold, "correct": s > 0,
                            "length": len(sample.tokens), "finish_reason": sample.finish_reason})
    return records


def evaluate_during_training(engine, tok, args, rank, world):
    """`stapo.py --eval-every K`: the same evaluation through the trainer's engine; returns eval/<name>."""
    from rollout import gather
    records = sum(gather(evaluate(
        engine, tok, args.eval_benchmarks.split(","), args.eval_samples or None, args.temperature, args.top_p,
        args.eval_max_tokens, rank, world, args.eval_data_dir or None, None, args.chat_template,
        args.enable_thinking, args.seed)), [])
    return {f"eval/{name}": r["avg@k"] for name, r in summarize(records).items()}


def compare(a, b):
    ra, rb = (json.load(open(os.path.join(d, "results.json")))["table"] for d in (a, b))
    print(f"| benchmark | {a} avg@k | {b} avg@k | difference |\n|---|---|---|---|")
    for name in dict.fromkeys([*ra, *rb]):
        x, y = ra.get(name, {}).get("avg@k"), rb.get(name, {}).get("avg@k")
        diff = f"{y - x:+.2f}" if x is not None and y is not None else "n/a"
        print(f"| {name} | {'-' if x is None else f'{x:.2f}'} | {'-' if y is None else f'{y:.2f}'} | {diff} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--benchmarks", default="all", help="comma list of " + ",".join(BENCHMARKS) + ", or all")
    p.add_argument("--preset", default="train", choices=list(PRESETS))
    p.add_argument("--samples", type=int, help="k for every benchmark (default: 32 AIME/AMC, 4 others)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--max-tokens", type=int, default=20480)
    p.add_argument("--limit", type=int, help="first N problems of each benchmark")
    p.add_argument("--data-dir", help="read <name>.jsonl files here instead of the Hub")
    p.add_argument("--out", default="runs/eval")
    p.add_argument("--engine", default="auto", choices=["auto", "vllm", "hf"])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--no-chat-template", dest="chat_template", action="store_false")
    p.add_argument("--enable-thinking", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", nargs=2, metavar=("OUT_A", "OUT_B"))
    a = p.parse_args(argv)
    if a.compare:
        return compare(*a.compare)
    if not a.model:
        p.error("--model is required (or --compare OUT_A OUT_B)")
    names = list(BENCHMARKS) if a.benchmarks == "all" else a.benchmarks.split(",")
    if any(n not in BENCHMARKS for n in names):
        p.error(f"--benchmarks: unknown {[n for n in names if n not in BENCHMARKS]}; choose from {list(BENCHMARKS)}")
    temperature, top_p = (x if x is not None else d for x, d in zip((a.temperature, a.top_p), PRESETS[a.preset]))
    import torch.distributed as dist
    from rollout import init_distributed
    own_group = not dist.is_initialized()
    rank, world, device, _ = init_distributed()
    try:
        run(a, names, temperature, top_p, rank, world, device)
    finally:
        if own_group:  # a clean exit: a live process group at interpreter exit can abort the process
            dist.destroy_process_group()


def run(a, names, temperature, top_p, rank, world, device):
    from transformers import AutoTokenizer
    from rollout import gather, make_engine
    tok = AutoTokenizer.from_pretrained(a.model)
    from transformers import AutoConfig
    longest = getattr(AutoConfig.from_pretrained(a.model), "max_position_embeddings", None) or 1 << 30
    engine = make_engine(a.engine, a.model, tok, device, max_model_len=min(a.max_tokens + 2048, longest),
                         gpu_memory_utilization=a.gpu_memory_utilization, for_training=False)
    t0 = time.time()
    records = sum(gather(evaluate(engine, tok, names, a.samples, temperature, top_p, a.max_tokens, rank, world,
                                  a.data_dir, a.limit, a.chat_template, a.enable_thinking, a.seed)), [])
    seconds = time.time() - t0
    if rank == 0:
        rows = summarize(records)
        os.makedirs(a.out, exist_ok=True)
        results = {"model": a.model, "preset": a.preset, "config": vars(a), "table": rows,
                   "samples_per_s": len(records) / seconds, "tokens_per_s": sum(r["length"] for r in records) / seconds}
        for name, text in (("samples.jsonl", "".join(json.dumps(r) + "\n" for r in records)),
                           ("summary.md", table(rows) + "\n"), ("results.json", json.dumps(results, indent=1))):
            with open(os.path.join(a.out, name), "w") as f:
                f.write(text)
        print(table(rows))


if __name__ == "__main__":
    main()
