"""problems.py: problems and prompts. Where the problems come from (a Hub id, a .jsonl or a .parquet, in
our layout or DAPO-Math's), the prompt the model sees, and which prompts and seeds each step and rank gets.
"""
import hashlib
import json
import os

import torch

from parallel import UserError

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


def encode_prompt(tok, problem, chat_template=True, enable_thinking=False, suffix=SUFFIX):
    """Token ids of the paper's prompt: the problem + SUFFIX, as a user turn of the chat template."""
    text = problem + suffix
    if chat_template and tok.chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True, enable_thinking=enable_thinking)
    return tok(text, add_special_tokens=False)["input_ids"]


def probe_tokens(tok, limit, chat_template=True):
    """PROBE as token ids, its question as a prompt and its answer after it, at most `limit` of them."""
    ids = encode_prompt(tok, PROBE[0], chat_template) + tok.encode(PROBE[1], add_special_tokens=False)
    return ids[:limit]


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
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such file")
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{i}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{i}: not an object")
            missing = [k for k in fields if row.get(k) is None]
            if missing:
                raise UserError(f"{path}:{i}: missing field {missing[0]!r}")
            rows.append((f"{path}:{i}", row))
    return rows


def problem_answer(row, where):
    """(problem, answer) of one row: ours ({problem, answer}) or DAPO-Math-17k's; `where` names it in errors."""
    if "prompt" not in row:
        missing = [k for k in ("problem", "answer") if row.get(k) is None]
        if missing:
            raise UserError(f"{where}: missing field {missing[0]!r}")
        return row["problem"], str(row["answer"])
    try:  # DAPO-Math-17k's own schema: the problem inside its instruction wrapper, the gold in reward_model
        content, gold = row["prompt"][0]["content"], str(row["reward_model"]["ground_truth"])
    except (KeyError, IndexError, TypeError):
        fields = "'prompt[0].content' or 'reward_model.ground_truth'"
        raise UserError(f"{where}: missing field {fields}") from None
    if content.startswith(DAPO_PREFIX) and content.endswith(DAPO_SUFFIX):
        content = content[len(DAPO_PREFIX):len(content) - len(DAPO_SUFFIX)]
    return content, gold


def read_dataset(spec, split):
    """[(where, row)] of a local .parquet file or a Hub dataset's split, read by `datasets` (imported here, so
    a run from .jsonl files never loads it: 0.85 s of every process's start, here)."""
    import datasets
    if spec.endswith(".parquet"):
        ds = datasets.load_dataset("parquet", data_files=spec, split="train")
    else:
        ds = datasets.load_dataset(spec, split=split)
    return [(f"{spec}: row {i}", r) for i, r in enumerate(ds)]


def load_problems(spec):
    """[(problem, answer)] from a local .jsonl/.parquet or a Hub dataset, duplicates of a problem dropped."""
    if spec.endswith(".jsonl"):
        rows = read_jsonl(spec)
    else:
        rows = read_dataset(spec, "train")
    seen, out = set(), []
    for where, row in rows:
        problem, answer = problem_answer(row, where)
        if problem not in seen:
            seen.add(problem)
            out.append((problem, answer))
    return out


def check_dataset(spec):
    """--dataset: a local .jsonl or .parquet file, or a Hub id (org/name); a local file of another kind is
    refused by name (datasets would report it as not found)."""
    local = os.path.exists(spec) or spec.startswith(("/", ".", "~")) or spec.count("/") != 1
    if spec.endswith((".jsonl", ".parquet")) or local:
        if not os.path.isfile(spec):
            raise UserError(f"--dataset {spec}: no such file (a .jsonl or .parquet file, or a Hub id such as "
                            "BytedTsinghua-SIA/DAPO-Math-17k)")
        if not spec.endswith((".jsonl", ".parquet")):
            raise UserError(f"--dataset {spec}: a .jsonl or .parquet file is read (one problem a line or row, "
                            "README: training data), not {os.path.splitext(spec)[1] or 'a file without extension'}")


def check_problems(data, dataset, dropped, max_prompt_len):
    """The training problems after the tokenizer: none at all, or none short enough, is refused."""
    if not data and not dropped:
        raise UserError(f"--dataset {dataset}: holds no problems")
    if not data:
        raise UserError(f"--dataset {dataset}: every one of its {dropped} prompts is longer than --max-prompt-len "
                        f"{max_prompt_len} tokens")


def step_prompts(data, step, per_step, minibatches, seed, rank, world):
    """This rank's share of step `step`'s `per_step` prompts, mini-batch by mini-batch: mini-batch b is the
    same block of prompts whatever the world size. The data is shuffled anew (seeded) every epoch."""
    per_mb, n = per_step // minibatches, len(data)
    first_epoch = step * per_step // n
    last_epoch = ((step + 1) * per_step - 1) // n
    orders = {e: torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + e))
              for e in range(first_epoch, last_epoch + 1)}
    out = []
    for b in range(minibatches):
        first = step * per_step + b * per_mb + rank * (per_mb // world)
        for g in range(first, first + per_mb // world):
            out.append((g, *data[int(orders[g // n][g % n])]))
    return out


def seed_of(*parts):
    """A 62-bit seed for a tuple of integers (run seed, step, prompt...). Distinct tuples give unrelated
    seeds, so the samples s + j of one request never share noise with another request's."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2
