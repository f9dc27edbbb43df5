"""evaluation.py: the paper's six math benchmarks as a library: their problems, avg@k with its protocol, and
the evaluation the trainer runs through its own engine (stapo.py --eval-every). eval.py is its command line.

k samples per problem (32 for AIME24/25 and AMC23, 4 for the others), each problem seeded; avg@k is the
mean accuracy over the k samples, pass@k the fraction of problems with a correct sample. "Correct" is
reward.score > 0 on the last \\boxed{}: gold conventions (AIME's zero padding, Minerva's e-notation,
OlympiadBench's unordered multi-answers) live in reward.py, not here.
"""
import functools
import os
import re
from dataclasses import dataclass

from parallel import gather
from problems import encode_prompt, problem_answer, read_dataset, read_jsonl, seed_of
from reward import check_all, extract_answer, extract_boxed

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


def benchmark_row(name, row, i, where):
    """One row mapped to {id, problem, answer}, from any of three layouts: ours (problem, answer),
    the Hub's (BENCHMARKS' columns), or verl's (prompt[0].content, reward_model.ground_truth: JustRL's
    parquet files)."""
    _, _, pcol, acol, _ = BENCHMARKS[name]
    rid = row.get("id", row.get("unique_id", (row.get("extra_info") or {}).get("index", i)))
    if pcol in row and acol in row and "prompt" not in row:
        problem, answer = row[pcol], row[acol]
    else:  # ours or verl's; a row missing a field is an error naming the file and line
        problem, answer = problem_answer(row, where)
    if isinstance(answer, list):  # OlympiadBench: final_answer is a list of strings
        answer = ", ".join(a.strip("$") for a in answer)
    elif isinstance(answer, float):  # AMC23 stores 27.0
        answer = str(int(answer)) if answer.is_integer() else str(answer)
    answer = str(answer).strip()
    answer = extract_boxed(answer) if "\\boxed" in answer else answer  # AIME24's Hub solution: \boxed{025}
    return {"id": str(rid), "problem": problem, "answer": re.sub(r"^\$([^$]*)\$$", r"\1", answer)}


@functools.lru_cache(maxsize=None)  # --eval-every reads each benchmark once per run, not once per evaluation
def load_benchmark(name, data_dir=None, source=None):
    """{id, problem, answer} rows of one benchmark: from `source` (a local .jsonl/.parquet in any layout
    benchmark_row reads), else <data_dir>/<name>.jsonl, else the Hub."""
    path = source or (os.path.join(data_dir, name + ".jsonl") if data_dir else None)
    if path and path.endswith(".jsonl"):
        rows = read_jsonl(path)
    else:
        hub, split = BENCHMARKS[name][:2]
        rows = read_dataset(path or hub, split)
    return [benchmark_row(name, r, i, where) for i, (where, r) in enumerate(rows)]


def per_problem(records, key):
    """{problem id: [each of its samples' `key`]}."""
    out = {}
    for r in records:
        out.setdefault(r["id"], []).append(r[key])
    return out


def avg_at_k(records, key):
    """The mean over problems of the percentage of their samples whose `key` is true."""
    per = per_problem(records, key).values()
    return 100 * sum(sum(c) / len(c) for c in per) / len(per)


def summarize(records):
    """One row per benchmark from per-sample records, plus the mean of avg@k over the benchmarks. With a
    judge, `avg@k judged` counts a sample right when the rules or the judge say so."""
    rows = {}
    for name in dict.fromkeys(r["benchmark"] for r in records):
        rs = [r for r in records if r["benchmark"] == name]
        right = per_problem(rs, "correct").values()
        rows[name] = {"n": len(right), "k": max(map(len, right)), "avg@k": avg_at_k(rs, "correct"),
                      "pass@k": 100 * sum(any(c) for c in right) / len(right),
                      "mean_len": sum(r["length"] for r in rs) / len(rs),
                      "truncated": sum(r["finish_reason"] == "length" for r in rs) / len(rs)}
        if "judged" in rs[0]:
            rows[name]["avg@k judged"] = avg_at_k(rs, "judged")
    if rows:
        averaged = [key for key in next(iter(rows.values())) if key.startswith("avg@k")]
        rows["average"] = {key: sum(r[key] for r in rows.values()) / len(rows) for key in averaged}
    return rows


@dataclass
class EvalOptions:
    """How evaluate() samples and grades each benchmark."""
    samples: int = None             # k for every benchmark (None: BENCHMARKS' k)
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 20480         # the response limit
    data_dir: str = None            # read <name>.jsonl here instead of the Hub
    limit: int = None               # the first N problems of each benchmark
    chat_template: bool = True      # the prompt as a user turn of the chat template
    enable_thinking: bool = False   # Qwen3's template in thinking mode
    seed: int = 0                   # every problem's samples are seeded from it
    sources: dict = None            # {name: a local .jsonl/.parquet}
    unboxed: bool = False           # grade reward.extract_answer's pick, not the last box (not the paper's)


def evaluate(engine, tok, names, opts, rank=0, world=1):
    """Per-sample records for this rank's share of each benchmark (problem i goes to rank i % world).
    Each benchmark's prompts go to the engine in one call; the answers are checked on parallel threads.
    The answer is the last box (the paper's protocol), or with opts.unboxed reward.extract_answer's pick."""
    records = []
    for name in names:
        every = load_benchmark(name, opts.data_dir, (opts.sources or {}).get(name))[:opts.limit]
        problems, k = every[rank::world], opts.samples or BENCHMARKS[name][4]
        prompts = [encode_prompt(tok, p["problem"], opts.chat_template, opts.enable_thinking)
                   for p in problems]
        seeds = [seed_of(opts.seed, i) for i in range(rank, len(every), world)]
        outs = engine.generate(prompts, k, opts.temperature, opts.top_p, opts.max_tokens, seeds,
                               progress=rank == 0, logprobs=False)  # the sampler's log-probs: never read
        texts = [tok.decode(s.tokens, skip_special_tokens=True) for out in outs for s in out]
        golds = [p["answer"] for p in problems for _ in range(k)]
        answers = [(extract_answer if opts.unboxed else extract_boxed)(text) for text in texts]
        for j, (text, gold, answer, ok) in enumerate(zip(texts, golds, answers, check_all(answers, golds))):
            sample = outs[j // k][j % k]
            records.append({"benchmark": name, "id": problems[j // k]["id"], "sample": j % k,
                            "problem": problems[j // k]["problem"], "completion": text,
                            "extracted": answer, "gold": gold, "correct": ok,
                            "length": len(sample.tokens), "finish_reason": sample.finish_reason})
    return records


def longest_prompt(tok, names, opts):
    """The longest prompt of the benchmarks `names`, in tokens: stapo.py --eval-every sizes its engine by it."""
    problems = [p for name in names for p in load_benchmark(name, opts.data_dir, (opts.sources or {}).get(name))]
    prompts = [encode_prompt(tok, p["problem"], opts.chat_template, opts.enable_thinking) for p in problems]
    return max(map(len, prompts))


def evaluate_during_training(engine, tok, names, opts, rank, world):
    """`stapo.py --eval-every K`: the evaluation through the trainer's engine, graded by the equivalence
    checker whatever --reward trains with; returns {eval/<name>: avg@k} over every rank's samples."""
    records = sum(gather(evaluate(engine, tok, names, opts, rank, world)), [])
    return {f"eval/{name}": r["avg@k"] for name, r in summarize(records).items()}
