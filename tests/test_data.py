"""Problems and prompts (problems.py): the datasets' schemas and their errors, deduplication, the
prompt's template, each step's prompts."""
import json
import os

import pytest

import problems
import stapo
from support import SHARED, args_for


def test_local_jsonl_bad_rows_name_file_line_and_field(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"problem": "1+1", "answer": "2"}\n\n{"problem": "2+2"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: missing field 'answer'"):
        problems.load_problems(str(p))
    p.write_text('{"problem": "1+1", "answer": "2"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        problems.load_problems(str(p))
    with pytest.raises(ValueError, match=r"x\.jsonl:1: missing field 'answer'"):
        (tmp_path / "x.jsonl").write_text('{"problem": "1"}\n')
        problems.read_jsonl(str(tmp_path / "x.jsonl"), ["problem", "answer"])


def test_parquet_and_dedup(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"problem": ["a", "b", "a"], "answer": ["1", "2", "1"]}), tmp_path / "d.parquet")
    assert problems.load_problems(str(tmp_path / "d.parquet")) == [("a", "1"), ("b", "2")]


def test_dapo_nested_schema_unwrapped_and_deduplicated(tmp_path):
    path, full = (os.path.join(SHARED, "train", f"dapo_math_17k{s}.jsonl") for s in ("_sample", ""))
    for f in (path, full):
        if not os.path.exists(f):
            pytest.skip(f"../shared/data/train/{os.path.basename(f)} is absent")
    rows = open(path).read().splitlines()
    (tmp_path / "dapo.jsonl").write_text("\n".join(rows + rows) + "\n")  # the Hub repeats every prompt
    got = problems.load_problems(str(tmp_path / "dapo.jsonl"))
    assert [a for _, a in got] == ["34", "113", "-3"]
    assert not any("Answer:" in p for p, _ in got)
    flat = [json.loads(x) for x in open(full).read().splitlines()[:3]]
    assert [p for p, _ in got] == [r["problem"] for r in flat]  # exactly the problem, whitespace kept


def test_prompt_suffix_and_chat_template(tiny):
    _, tok = tiny
    ids = problems.encode_prompt(tok, "What is 1 + 2?")
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>user\nWhat is 1 + 2?" + problems.SUFFIX) and text.endswith("assistant\n")
    raw = tok.decode(problems.encode_prompt(tok, "What is 1 + 2?", chat_template=False))
    assert raw == "What is 1 + 2?" + problems.SUFFIX


def test_bad_split_is_an_error(tiny, tmp_path):
    d, _ = tiny
    with pytest.raises(ValueError, match="--prompts-per-step 4 must split evenly into --minibatches 3"):
        stapo.train(stapo.get_args(args_for(d, tmp_path, "--minibatches", "3")))


def test_step_prompts_split_by_minibatch_and_cover_each_epoch_once():
    data = [(f"p{i}", str(i)) for i in range(10)]
    one = [problems.step_prompts(data, s, 4, 2, 3, 0, 1) for s in range(5)]  # 4 prompts, 2 mini-batches, seed 3
    for s in range(5):  # two ranks hold, mini-batch by mini-batch, what one process holds
        r0, r1 = (problems.step_prompts(data, s, 4, 2, 3, r, 2) for r in (0, 1))
        assert one[s] == [r0[0], r1[0], r0[1], r1[1]]
    flat = [x for step in one for x in step]
    assert [g for g, _, _ in flat] == list(range(20))
    for epoch in (0, 1):  # steps 2 spans the epoch boundary; each epoch is a permutation of the data
        assert sorted(p for g, p, _ in flat if g // 10 == epoch) == sorted(p for p, _ in data)
    assert [p for g, p, _ in flat[:10]] != [p for g, p, _ in flat[10:]]  # reshuffled each epoch
