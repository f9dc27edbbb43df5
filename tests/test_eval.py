"""eval.py: benchmark loading (offline copies and Hub layouts), metrics, end to end, compare, bad data."""
import argparse
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import eval as ev
import evaluation
import problems
import stapo
from problems import seed_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "..", "shared", "data", "benchmarks")


@pytest.mark.skipif(not os.path.isdir(BENCH), reason="../shared/data/benchmarks is absent")
def test_offline_benchmarks_load_with_the_right_counts():
    counts = {name: len(evaluation.load_benchmark(name, BENCH)) for name in evaluation.BENCHMARKS}
    assert counts == {"aime24": 30, "aime25": 30, "amc23": 40, "math500": 500, "minerva": 272, "olympiadbench": 675}
    assert [evaluation.BENCHMARKS[n][4] for n in evaluation.BENCHMARKS] == [32, 32, 32, 4, 4, 4]


HUB_ROWS = {  # one row in each Hub dataset's own layout, and what it must map to
    "aime24": ({"id": 60, "problem": "P", "solution": "\\boxed{025}", "url": "u"}, "025"),
    "aime25": ({"id": "0", "problem": "P", "answer": "70"}, "70"),
    "amc23": ({"id": 0, "question": "P", "answer": 27.0, "url": "u"}, "27"),
    "math500": ({"problem": "P", "solution": "s", "answer": "\\frac{1}{2}", "subject": "x", "level": 1,
                 "unique_id": "test/x/1.json"}, "\\frac{1}{2}"),
    "minerva": ({"question": "P", "answer": "4.5e33"}, "4.5e33"),
    "olympiadbench": ({"id": 2253, "question": "P", "solution": ["s"], "final_answer": ["$45$"],
                       "is_multiple_answer": False, "unit": "minute"}, "45"),
}


@pytest.mark.parametrize("name", list(HUB_ROWS))
@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_hub_column_mapping(name, fmt, tmp_path):
    row, answer = HUB_ROWS[name]
    path = tmp_path / f"{name}.{fmt}"
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist([row, row]), path)
    else:
        path.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    got = evaluation.load_benchmark(name, source=str(path))
    assert got[0]["problem"] == "P" and got[0]["answer"] == answer and len(got) == 2
    assert got[0]["id"] == str(row.get("id", row.get("unique_id", 0)))


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_verl_layout_of_justrl_files(fmt, tmp_path):
    """JustRL's data/*/test.parquet: the problem in prompt[0].content, the gold in reward_model, the id in
    extra_info; its golds come wrapped in $...$."""
    row = {"prompt": [{"content": "P", "role": "user"}], "data_source": "Olympiad-Bench", "ability": "math",
           "reward_model": {"ground_truth": "$(1,2)$", "style": "rule"},
           "extra_info": {"index": "Olympiad-Bench-7", "split": "test"}}
    path = tmp_path / f"olympiadbench.{fmt}"
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist([row]), path)
    else:
        path.write_text(json.dumps(row) + "\n")
    assert evaluation.load_benchmark("olympiadbench", source=str(path)) == [
        {"id": "Olympiad-Bench-7", "problem": "P", "answer": "(1,2)"}]


@pytest.mark.skipif(not os.path.isdir(BENCH), reason="../shared/data/benchmarks is absent")
@pytest.mark.slow  # subprocesses: the CLIs, or a whole training run
def test_justrl_olympiadbench_variant_from_the_command_line(tiny, tmp_path):
    """JustRL's 674-row OlympiadBench (relay problems given a concrete T, id 1965 dropped, golds in $...$)
    loads through --source (a malformed --source is refused by name: test_bad_arguments)."""
    variant = os.path.join(BENCH, "variants", "justrl", "olympiadbench.jsonl")
    rows = evaluation.load_benchmark("olympiadbench", source=variant)
    assert len(rows) == 674 and not any(r["answer"].startswith("$") for r in rows)
    relay = "Let $T=T N Y W R$"  # "the number you will receive": unsolvable alone
    assert sum(relay in r["problem"] for r in rows) == 0
    assert sum(relay in r["problem"] for r in evaluation.load_benchmark("olympiadbench", BENCH)) == 15
    r = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), "--model", str(tiny[0] / "model"),
                        "--benchmarks", "olympiadbench", "--source", f"olympiadbench={variant}", "--limit", "1",
                        "--samples", "1", "--max-tokens", "4", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    sample = json.loads(open(tmp_path / "o" / "samples.jsonl").readline())
    assert sample["problem"] == rows[0]["problem"] and sample["gold"] == rows[0]["answer"]


def test_olympiad_multi_answer_golds_join():
    row = {"id": 1, "question": "P", "final_answer": ["$(1,8,19)$", "$(2,7,13)$"]}
    assert evaluation.benchmark_row("olympiadbench", row, 0, "x")["answer"] == "(1,8,19), (2,7,13)"


def test_avg_and_pass_at_k_by_hand():
    rec = lambda b, i, c, n=10, f="stop": {"benchmark": b, "id": i, "correct": c, "length": n,  # noqa: E731
                                          "finish_reason": f}
    records = [rec("a", "1", True), rec("a", "1", False), rec("a", "1", False), rec("a", "1", True),
               rec("a", "2", False), rec("a", "2", False), rec("a", "2", False), rec("a", "2", False, 30, "length"),
               rec("b", "x", True), rec("b", "x", True)]
    rows = evaluation.summarize(records)
    assert rows["a"] == {"n": 2, "k": 4, "avg@k": 25.0, "pass@k": 50.0, "mean_len": 12.5, "truncated": 0.125}
    assert rows["b"]["avg@k"] == 100.0 and rows["b"]["pass@k"] == 100.0 and rows["b"]["k"] == 2
    assert rows["average"]["avg@k"] == 62.5


def six_benchmarks(d, bad=None):
    """A data dir with the six files: 3 problems each, 1 + 1 = 2 style."""
    d.mkdir(exist_ok=True)
    for name in evaluation.BENCHMARKS:
        lines = [json.dumps({"id": str(i), "problem": f"What is {i} + 1?", "answer": str(i + 1)}) for i in range(3)]
        if name == bad:
            lines[1] = '{"id": "1", "problem": "What is 1 + 1?"}'
        (d / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return d


@pytest.mark.slow  # subprocesses: the CLIs, or a whole training run
def test_end_to_end_on_the_toy_model_and_compare(tiny, tmp_path, capsys):
    """Run a on the CPU; run b with --judge (the toy model as a useless judge) on tests/fake_cuda's driver in
    its default compute mode (the HF engine on the CPU): --judge is one command there, its sampler's context
    beside its judge's on the one GPU (test_the_judge_on_gpus_that_allow_one_cuda_context has the exclusive
    mode). The tables, the samples, the verdicts, and --compare of the two."""
    model = str(tiny[0] / "model")
    data = six_benchmarks(tmp_path / "data")
    cmd = [sys.executable, os.path.join(ROOT, "eval.py"), "--model", model, "--data-dir", str(data),
           "--limit", "2", "--samples", "2", "--max-tokens", "32"]
    judge = ["--judge", model, "--judge-max-tokens", "2", "--engine", "hf", "--dtype", "fp32"]
    contexts, on_a_gpu = fake_cuda(tmp_path, "default", "Default")
    for out, extra, env in (("a", [], None), ("b", judge, on_a_gpu)):
        r = subprocess.run(cmd + ["--out", str(tmp_path / out), "--seed", str(ord(out))] + extra,
                           capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
    summary = (tmp_path / "a" / "summary.md").read_text()
    for name in evaluation.BENCHMARKS:
        assert f"| {name} | 2 | 2 |" in summary
    assert "**average**" in summary
    res = json.load(open(tmp_path / "a" / "results.json"))
    assert res["model"] == model and res["preset"] == "train" and res["samples_per_s"] > 0 and res["tokens_per_s"] > 0
    samples = [json.loads(x) for x in open(tmp_path / "a" / "samples.jsonl")]
    assert len(samples) == 6 * 2 * 2
    assert {"benchmark", "id", "sample", "problem", "completion", "extracted", "gold", "correct", "length",
            "finish_reason"} == samples[0].keys()
    # the table agrees with the samples
    for name in evaluation.BENCHMARKS:
        rs = [s for s in samples if s["benchmark"] == name]
        assert res["table"][name]["avg@k"] == pytest.approx(100 * sum(s["correct"] for s in rs) / len(rs))
    capsys.readouterr()
    ev.main(["--compare", str(tmp_path / "a"), str(tmp_path / "b")])  # eval.py --compare A B, in this process
    compared = capsys.readouterr().out
    assert compared.count("\n") == 2 + 7
    rb = json.load(open(tmp_path / "b" / "results.json"))["table"]
    judged = [json.loads(x) for x in open(tmp_path / "b" / "samples.jsonl")]
    assert all(s["judged"] == (s["correct"] or s["judge"] == "A") for s in judged)
    assert all(s["judge"] is None for s in judged if s["correct"])
    assert "avg@k rule+judge (%)" in (tmp_path / "b" / "summary.md").read_text()
    assert rb["math500"]["avg@k judged"] >= rb["math500"]["avg@k"]
    res_b = json.load(open(tmp_path / "b" / "results.json"))
    assert res_b["judge_s_per_judged_sample"] > 0 and res_b["judge"] == model
    assert res_b["judge_pids"] and not set(res_b["judge_pids"]) & set(res_b["sampler_pids"])  # a process of its own
    pids = res_b["sampler_pids"] + res_b["judge_pids"]
    assert sorted(map(int, (contexts / "1").read_text().split())) == sorted(pids)  # two contexts, one GPU
    diff = rb["math500"]["avg@k"] - res["table"]["math500"]["avg@k"]
    assert f"| math500 | {res['table']['math500']['avg@k']:.2f} | {rb['math500']['avg@k']:.2f} | {diff:+.2f} |" \
        in compared


def test_a_failed_or_killed_judge_loses_nothing_and_a_rerun_judges_only_what_is_missing(tiny, tmp_path):
    """The judge fails to start (its folder holds no model; a missing folder is refused before sampling):
    eval.py exits non-zero and says how to finish, every sample and rule verdict on
    disk. A judge process then SIGKILLed after 2 calls of 2 samples keeps those 4 verdicts, and --judge-only
    judges the 8 others, each once, in a new process, and merges them in."""
    model, data, out = str(tiny[0] / "model"), tmp_path / "data", tmp_path / "out"
    data.mkdir()
    for name in ("math500", "minerva"):  # golds no sample matches: all 12 samples go to the judge
        (data / f"{name}.jsonl").write_text("".join(json.dumps({"id": str(i), "problem": f"What is {i} + 1?",
                                                                "answer": "-7"}) + "\n" for i in range(3)))
    evaluate = [sys.executable, os.path.join(ROOT, "eval.py"), "--model", model, "--data-dir", str(data),
                "--benchmarks", "math500,minerva", "--samples", "2", "--max-tokens", "8", "--out", str(out)]
    judge = ["--judge", model, "--judge-max-tokens", "2"]
    run = lambda cmd: subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)  # noqa: E731
    (tmp_path / "broken_judge").mkdir()  # a folder with no model in it: the judge's process fails to load it
    r = run(evaluate + ["--judge", str(tmp_path / "broken_judge")])
    assert r.returncode == 1 and "12 rejected samples have no verdict" in r.stderr, r.stderr[-2000:]
    assert f"python eval.py --judge-only --out {out} --judge" in r.stderr
    samples = [json.loads(x) for x in open(out / "samples.jsonl")]
    assert len(samples) == 12 and not any(s["correct"] or "judge" in s for s in samples)
    assert json.load(open(out / "results.json"))["table"]["math500"]["avg@k"] == 0

    r = run([sys.executable, os.path.join(ROOT, "tests", "judge_crash.py"), "2", "--judge-shard", "0/1",
             "--out", str(out), *judge])
    assert r.returncode == -9, r.stderr[-2000:]
    killed = [json.loads(x) for x in open(out / "judged.0.jsonl") if x.strip()]
    assert len(killed) == 4 and (out / "samples.jsonl").read_text() == "".join(json.dumps(s) + "\n" for s in samples)

    r = run([sys.executable, os.path.join(ROOT, "eval.py"), "--judge-only", "--out", str(out), *judge])
    assert r.returncode == 0, r.stderr[-2000:]
    verdicts = [json.loads(x) for x in open(out / "judged.0.jsonl") if x.strip()]
    keys = [(v["benchmark"], v["id"], v["sample"]) for v in verdicts]
    assert verdicts[:4] == killed and len(keys) == len(set(keys)) == 12  # each judged once
    assert len({v["pid"] for v in verdicts[4:]} - {v["pid"] for v in killed}) == 1
    judged = [json.loads(x) for x in open(out / "samples.jsonl")]
    assert [{k: s[k] for k in samples[0]} for s in judged] == samples  # the samples and rule verdicts as they were
    assert all(s["judged"] == (s["judge"] == "A") for s in judged)
    assert "avg@k judged" in json.load(open(out / "results.json"))["table"]["math500"]


def test_malformed_benchmark_file_names_file_and_line(tmp_path):
    data = six_benchmarks(tmp_path / "data", bad="minerva")
    with pytest.raises(ValueError, match=r"minerva\.jsonl:2: missing field 'answer'"):
        evaluation.load_benchmark("minerva", str(data))


@pytest.mark.slow  # subprocesses: the CLIs, or a whole training run
def test_bad_arguments(tmp_path, capsys):
    """Each bad argument is refused by the parser, before any work: one line on stderr naming it, exit code 2.
    A real process for one of them (the exit code and the one line are the program's, not only main()'s);
    the others through eval.main in this process, where the same parser refuses them the same way."""
    # a missing judge template: refused before any sampling (not read first in the judges, after it)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), "--model", str(tmp_path), "--judge",
                        str(tmp_path), "--judge-prompt", str(tmp_path / "judge.txt")], capture_output=True, text=True,
                       cwd=ROOT)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and f"--judge-prompt {tmp_path / 'judge.txt'}: no such" in lines[0]
    for argv, says in ((["--model", "x", "--benchmarks", "gsm8k"], "unknown ['gsm8k']"),
                       (["--model", "x", "--source", "gsm8k=a.jsonl"], "--source: expected NAME=FILE")):
        with pytest.raises(SystemExit) as stop:
            ev.main(argv)
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert stop.value.code == 2 and len(lines) == 1 and says in lines[0], (argv, lines)


@pytest.mark.slow  # subprocesses: the CLIs, or a whole training run
def test_eval_during_training(tiny, tmp_path):
    d, _ = tiny
    data = six_benchmarks(tmp_path / "data")
    stapo.train(stapo.get_args(["--model", str(d / "model"), "--dataset", str(d / "train.jsonl"), "--out",
                                str(tmp_path / "run"), "--prompts-per-step", "4", "--group-size", "2",
                                "--minibatches", "1", "--max-response-len", "6", "--steps", "2", "--save-every", "0",
                                "--max-prompt-len", "64", "--eval-every", "1", "--eval-benchmarks", "aime24,math500",
                                "--eval-samples", "2", "--eval-max-tokens", "8", "--eval-data-dir", str(data)]))
    m = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(m) == 2 and all({"eval/aime24", "eval/math500", "eval/average"} <= x.keys() for x in m)
    assert all(0 <= x["eval/aime24"] <= 100 for x in m)


def test_eval_during_training_gets_the_context_it_asks_for(tiny, tmp_path, monkeypatch):
    """vLLM stops an answer at its context without a word, so the training engine's context covers the
    longest eval prompt + --eval-max-tokens, and a length the model cannot hold is refused by name."""
    d, tok = tiny
    data = six_benchmarks(tmp_path / "data")
    argv = ["--model", str(d / "model"), "--dataset", str(d / "train.jsonl"), "--out", str(tmp_path / "run"),
            "--prompts-per-step", "4", "--minibatches", "1", "--max-prompt-len", "64", "--max-response-len", "6",
            "--eval-every", "1", "--eval-benchmarks", "aime24,math500", "--eval-data-dir", str(data)]
    longest = evaluation.longest_prompt(tok, ["aime24", "math500"], evaluation.EvalOptions(data_dir=str(data)))
    assert longest == max(len(problems.encode_prompt(tok, r["problem"])) for n in ("aime24", "math500")
                          for r in evaluation.load_benchmark(n, str(data)))
    seen = []

    def engine(kind, model, tok, device, context, *rest, **kw):
        seen.append(context)
        raise KeyboardInterrupt  # the context is all this test needs
    monkeypatch.setattr(stapo, "make_engine", engine)  # stapo imports it by name
    with pytest.raises(KeyboardInterrupt):
        stapo.train(stapo.get_args(argv + ["--eval-max-tokens", "100"]))
    assert seen == [longest + 100] and longest + 100 > 70  # more than a training sample's 64 + 6
    with pytest.raises(ValueError, match=rf"the longest eval prompt \+ --eval-max-tokens is {longest + 300} tokens, "
                                         r"beyond the 256 positions of --model"):
        stapo.train(stapo.get_args(argv + ["--eval-max-tokens", "300"]))
    with pytest.raises(ValueError, match=r"--max-prompt-len \+ --max-response-len is 1030 tokens"):
        stapo.train(stapo.get_args(argv[:-6] + ["--max-prompt-len", "1024"]))


def test_eval_during_training_decodes_with_its_preset_and_grades_with_the_checker(tiny, tmp_path):
    """--eval-preset justrl decodes at eval.PRESETS["justrl"] (0.7, 0.9), not the training's 1.0 / 1.0; and with
    --reward dapo the evaluation still grades with the equivalence checker: `\\boxed{03}` for the gold 3 counts.
    Breaks if the evaluation took the training's temperature, or the training's reward."""
    import parallel
    from rollout import Sample
    d, tok = tiny
    data = six_benchmarks(tmp_path / "data")
    args = stapo.get_args(["--model", str(d / "model"), "--eval-preset", "justrl", "--reward", "dapo",
                           "--eval-benchmarks", "math500", "--eval-samples", "2", "--eval-data-dir", str(data)])
    gold = {tuple(problems.encode_prompt(tok, f"What is {i} + 1?")): str(i + 1) for i in range(3)}
    seen = []

    class PaddedAnswers:
        def generate(self, prompts, n, temperature, top_p, max_tokens, seeds, progress=False, logprobs=True):
            seen.append((temperature, top_p))
            box = lambda p: tok(f"\\boxed{{0{gold[tuple(p)]}}}", add_special_tokens=False)["input_ids"]  # noqa
            return [[Sample(box(p), "stop")] * n for p in prompts]
    parallel.init_distributed()
    opts = stapo.eval_options(args)
    assert evaluation.evaluate_during_training(PaddedAnswers(), tok, ["math500"], opts, 0, 1)["eval/math500"] == 100.0
    assert seen == [evaluation.PRESETS["justrl"]] and stapo.get_args([]).eval_preset == "train"


class SeedEngine:
    """Answers \\boxed{7 seed % 5} for every sample: what a problem gets depends only on its seed."""

    def __init__(self, tok):
        self.tok = tok

    def generate(self, prompts, n, temperature, top_p, max_tokens, seeds, progress=False, logprobs=True):
        from rollout import Sample
        return [[Sample(self.tok(f"\\boxed{{{7 * s % 5}}}", add_special_tokens=False)["input_ids"], "stop")] * n
                for s in seeds]


def test_sharding_over_ranks_gives_the_records_of_one_process(tiny, tmp_path):
    _, tok = tiny
    data = six_benchmarks(tmp_path / "data")
    opts = evaluation.EvalOptions(samples=2, max_tokens=8, data_dir=str(data), seed=5)
    run = lambda rank, world: evaluation.evaluate(SeedEngine(tok), tok, ["aime24", "minerva"], opts, rank, world)  # noqa
    key = lambda r: (r["benchmark"], r["id"], r["sample"])  # noqa: E731
    one = sorted(run(0, 1), key=key)
    assert sorted(run(0, 2) + run(1, 2), key=key) == one and len(one) == 2 * 3 * 2
    golds = [r["gold"] for r in one if r["benchmark"] == "aime24"][::2]
    expect = [str(7 * seed_of(5, i) % 5) == g for i, g in enumerate(golds) for _ in range(2)]
    assert [r["correct"] for r in one if r["benchmark"] == "aime24"] == expect


def test_seeds_of_two_runs_share_no_sample():
    """vLLM seeds sample j of a request seeded s with s + j: with seed + problem index as the request seed,
    --seed 0 and --seed 1 shared 31 of 32 samples per AIME problem. Every (run seed, problem, j) must differ."""
    def sample_seeds(run_seed, problems=30, k=32):
        return {seed_of(run_seed, i) + j for i in range(problems) for j in range(k)}
    a, b = sample_seeds(0), sample_seeds(1)
    assert len(a) == len(b) == 30 * 32 and not a & b


@pytest.mark.slow  # subprocesses: the CLIs, or a whole training run
def test_the_clis_exit_cleanly_again_and_again_on_a_loaded_machine(tiny, tmp_path):
    """A process group or reward workers left alive at exit made eval.py abort now and then under load
    ('terminate called without an active exception', SIGABRT). Two CPU burners load both cores, and the three
    runs (eval.py twice, stapo.py once) go at once, each loading the cores for the others: five busy processes
    on two cores. The abort is rare even with its cause in place (a process group left alive made none here),
    so each run's last exit hook (tests/exit_spy) also says whether a cause is there: the process group
    destroyed and no child process (eval.py's reward workers) still running, on every exit."""
    d, _ = tiny
    data = six_benchmarks(tmp_path / "data")
    evaluate = [sys.executable, os.path.join(ROOT, "eval.py"), "--model", str(d / "model"), "--data-dir", str(data),
                "--benchmarks", "math500,minerva", "--limit", "2", "--samples", "2", "--max-tokens", "8", "--out"]
    train = [sys.executable, os.path.join(ROOT, "stapo.py"), "--model", str(d / "model"), "--dataset",
             str(d / "train.jsonl"), "--out", str(tmp_path / "t"), "--prompts-per-step", "2", "--group-size", "2",
             "--minibatches", "1", "--max-response-len", "4", "--steps", "1", "--save-every", "0",
             "--max-prompt-len", "64"]
    spied = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests", "exit_spy"), ROOT,
                                                          *filter(None, [os.environ.get("PYTHONPATH")])])}
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    runs = []
    try:
        for i, cmd in enumerate([evaluate + [str(tmp_path / "e0")], evaluate + [str(tmp_path / "e1")], train]):
            with open(tmp_path / f"{i}.out", "w") as out, open(tmp_path / f"{i}.err", "w") as err:
                runs.append(subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, env=spied))
        for i, p in enumerate(runs):
            code, err = p.wait(timeout=600), (tmp_path / f"{i}.err").read_text()
            assert code == 0 and "terminate called" not in err, (i, code, err[-2000:])
            said = re.findall(r"exit spy: (process group alive: \w+; child processes alive: \d+)", err)
            assert said and set(said) == {"process group alive: False; child processes alive: 0"}, (i, said)
    finally:
        for p in burners + runs:
            p.kill()
            p.wait()


def test_a_rank_with_no_problems_returns_no_records(tiny, tmp_path):
    """More ranks than problems after --limit: the idle rank's engine gets no prompts and must not crash
    (the others would wait for it in the gather)."""
    d, tok = tiny
    from rollout import HFEngine
    import torch
    engine = HFEngine(str(d / "model"), torch.device("cpu"), torch.float32, tok.eos_token_id)
    data = six_benchmarks(tmp_path / "data")
    opts = evaluation.EvalOptions(samples=2, max_tokens=4, data_dir=str(data), limit=2)
    assert evaluation.evaluate(engine, tok, ["math500"], opts, rank=3, world=4) == []
    assert len(evaluation.evaluate(engine, tok, ["math500"], opts, rank=1, world=4)) == 2


class TextEngine:
    """Writes the same text for every sample."""

    def __init__(self, tok, text):
        self.ids = tok(text, add_special_tokens=False)["input_ids"]

    def generate(self, prompts, n, temperature, top_p, max_tokens, seeds, progress=False, logprobs=True):
        from rollout import Sample
        return [[Sample(self.ids, "stop")] * n for _ in prompts]


def test_unboxed_answers_count_only_with_the_flag(tiny, tmp_path):
    _, tok = tiny
    data = six_benchmarks(tmp_path / "data")  # golds 1, 2, 3
    engine = TextEngine(tok, "So the answer is $2$.")
    opts = evaluation.EvalOptions(samples=1, max_tokens=8, data_dir=str(data))
    boxed = evaluation.evaluate(engine, tok, ["math500"], opts)
    unboxed = evaluation.evaluate(engine, tok, ["math500"], evaluation.EvalOptions(**{**vars(opts), "unboxed": True}))
    assert [r["correct"] for r in boxed] == [False] * 3 and boxed[0]["extracted"] is None
    assert [r["correct"] for r in unboxed] == [False, True, False] and unboxed[1]["extracted"] == "2"


def test_the_judge_sees_each_rejected_sample_and_only_its_A_counts(tiny, tmp_path, monkeypatch):
    """The real toy model generates the judge's replies; the verdicts are faked in order (A, B, C, none),
    since a tiny model cannot judge. Samples the rules accept are never sent to the judge."""
    import torch
    import reward
    d, tok = tiny
    template = tmp_path / "judge.txt"
    template.write_text("Q:{question} G:{gold_answer} R:{llm_response} V:")
    seen, verdicts = [], iter(["A", "B", "C", None])
    real_prompt = reward.judge_prompt
    monkeypatch.setattr(ev, "judge_prompt", lambda *x: seen.append(x) or real_prompt(*x))  # eval's own names
    monkeypatch.setattr(ev, "judge_verdict", lambda reply: next(verdicts))
    records = [{"problem": f"P{i}", "gold": str(i), "completion": f"x{i}", "correct": i == 2} for i in range(5)]
    from rollout import HFEngine
    engine = HFEngine(str(d / "model"), torch.device("cpu"), torch.float32, tok.eos_token_id)
    ev.judge(records, engine, tok, template.read_text(), max_tokens=2)
    assert [x[:3] for x in seen] == [(f"P{i}", str(i), f"x{i}") for i in (0, 1, 3, 4)]
    assert seen[0][3] == template.read_text()
    assert [r["judge"] for r in records] == ["A", "B", None, "C", None]
    assert [r["judged"] for r in records] == [True, False, True, False, False]


def fake_cuda(tmp_path, name, mode):
    """The environment of a process on tests/fake_cuda's driver, GPU 1 visible, `mode` its compute mode; the
    folder of its contexts."""
    contexts, fake = tmp_path / name, os.path.join(ROOT, "tests", "fake_cuda")
    contexts.mkdir()
    return contexts, {**os.environ, "FAKE_CUDA_DIR": str(contexts), "FAKE_CUDA_MODE": mode,
                      "CUDA_VISIBLE_DEVICES": "1", "PYTHONPATH": os.pathsep.join([fake, ROOT]),
                      "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "no-mps"),
                      "PATH": os.pathsep.join([fake, os.environ["PATH"]]), "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.slow  # subprocesses: the CLIs, or a whole training run
def test_the_judge_on_gpus_that_allow_one_cuda_context(tiny, tmp_path):
    """EXCLUSIVE_PROCESS compute mode, on a fake driver that enforces its one context per GPU (tests/fake_cuda),
    with the HF engine on the CPU. eval.py --judge refuses before it generates, naming the mode and both ways
    out; eval.py without --judge, then --judge-only, judges every rejected sample, from a parent that never made
    a CUDA context. (The default mode, where --judge is one command, its sampler's context beside its judge's:
    test_end_to_end_on_the_toy_model_and_compare's run b.) Breaks if the eval rank keeps its context
    (set_device): every judge's process would fail as busy."""
    model, data = str(tiny[0] / "model"), tmp_path / "data"
    data.mkdir()
    (data / "math500.jsonl").write_text("".join(json.dumps({"id": str(i), "problem": f"What is {i} + 1?",
                                                            "answer": "-7"}) + "\n" for i in range(2)))
    evaluate = [sys.executable, os.path.join(ROOT, "eval.py"), "--model", model, "--data-dir", str(data),
                "--benchmarks", "math500", "--samples", "2", "--max-tokens", "8", "--engine", "hf", "--dtype", "fp32"]
    judge = ["--judge", model, "--judge-max-tokens", "2", "--engine", "hf", "--dtype", "fp32"]
    run = lambda cmd, env: subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)  # noqa

    _, env = fake_cuda(tmp_path, "refused", "Exclusive_Process")
    r = run(evaluate + judge + ["--out", str(tmp_path / "a")], env)
    assert r.returncode == 1 and "GPU(s) 1 are in EXCLUSIVE_PROCESS compute mode" in r.stderr, r.stderr[-2000:]
    assert "nvidia-smi -c DEFAULT" in r.stderr and f"eval.py --judge-only --out {tmp_path / 'a'}" in r.stderr
    assert not (tmp_path / "a" / "samples.jsonl").exists() and "busy" not in r.stderr  # nothing generated

    _, env = fake_cuda(tmp_path, "sampled", "Exclusive_Process")
    assert run(evaluate + ["--out", str(tmp_path / "a")], env).returncode == 0
    contexts, env = fake_cuda(tmp_path, "judged", "Exclusive_Process")
    r = run([sys.executable, os.path.join(ROOT, "eval.py"), "--judge-only", "--out", str(tmp_path / "a"), *judge], env)
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.load(open(tmp_path / "a" / "results.json"))
    assert (contexts / "1").read_text().split() == [str(pid) for pid in results["judge_pids"]]  # the judge's alone
    assert all("judged" in s for s in map(json.loads, open(tmp_path / "a" / "samples.jsonl")))  # merged


# ---- --judge's check of this rank's GPU, on a fake nvidia-smi (tests/fake_nvidia_smi) ----------------------

H100 = "NVIDIA H100 80GB HBM3"
UUIDS = ["GPU-0aa6c3d1-7e2b-4f3c-9d1a-5b8e2f6c4a01", "GPU-1bb7d4e2-8f3c-4a4d-8e2b-6c9f3a7d5b02",
         "GPU-1bc8e5f3-9a4d-4b5e-9f3c-7d0a4b8e6c03"]
MIG = "MIG-5c6d7e8f-1a2b-5c3d-8e4f-9a0b1c2d3e4f"


def node(*modes, names=(H100,) * 3, migs=()):
    """A node's GPUs for the fake nvidia-smi: GPU i in compute mode modes[i]; GPU 1 holds the MIG devices."""
    return {"gpus": [{"uuid": UUIDS[i], "index": i, "pci.bus_id": f"00000000:{0x10 * (i + 1):02X}:00.0",
                      "compute_mode": mode, "name": names[i], "migs": list(migs) * (i == 1)}
                     for i, mode in enumerate(modes)]}


@pytest.fixture
def smi(monkeypatch, tmp_path):
    """Sets the node that nvidia-smi (the fake, first on PATH) reports, and CUDA_VISIBLE_DEVICES (None:
    unset); no MPS daemon and no CUDA_DEVICE_ORDER unless a test sets them."""
    fake = os.path.join(ROOT, "tests", "fake_nvidia_smi")
    monkeypatch.setenv("PATH", os.pathsep.join([fake, os.environ["PATH"]]))
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "no-mps"))
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)

    def set_node(spec, visible=None):
        monkeypatch.setenv("FAKE_NVIDIA_SMI", json.dumps(spec))
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    return set_node


DEX = ("Default", "Exclusive_Process")  # GPU 0 shared, GPU 1 exclusive


@pytest.mark.parametrize("visible,local,verdict", [
    ("1", 0, ("exclusive", "1")), ("0", 0, ("ok", None)),
    ("0,1", 0, ("ok", None)), ("0,1", 1, ("exclusive", "1")),  # only this rank's GPU counts
    ("1,0", 1, ("ok", None)),
    (None, 0, ("ok", None)), (None, 1, ("exclusive", "1")),    # unset: every GPU visible; this rank's counts
    ("0,-1,1", 1, ("ok", None)), ("0,x,1", 1, ("ok", None)),  # an invalid entry ends the list: GPU 1 unseen
])
def test_the_judge_checks_this_ranks_gpu_by_index(smi, visible, local, verdict):
    smi(node(*DEX), visible)
    assert ev.gpu_mode(local) == verdict


@pytest.mark.parametrize("visible,verdict", [
    (UUIDS[1], ("exclusive", "1")), (UUIDS[0], ("ok", None)),
    ("GPU-1bb7", ("exclusive", "1")),                         # a prefix that names one GPU, as CUDA takes it
    ("GPU-1b", ("ok", None)), ("GPU-1bb7x", ("ok", None)),    # naming two, or none: invalid, none visible
    (f"{UUIDS[0]},{UUIDS[1]}", ("ok", None)),
])
def test_the_judge_checks_this_ranks_gpu_by_uuid(smi, visible, verdict):
    smi(node(*DEX, "Default"), visible)
    assert ev.gpu_mode(0) == verdict


@pytest.mark.parametrize("visible", [MIG, MIG[:12], f"MIG-{UUIDS[1]}/1/0"])
def test_a_mig_device_is_checked_by_its_gpus_compute_mode(smi, visible):
    """A MIG device (its UUID, a prefix of it, or the older MIG-GPU-<uuid>/<gi>/<ci>) has its GPU's compute
    mode, which nvidia-smi's --query-gpu reports (MIG devices are no rows of it). Breaks if the device is
    asked for by its MIG id (nvidia-smi -i MIG-... names no device, and the check would let the run through)."""
    smi(node(*DEX, migs=[MIG]), visible)
    assert ev.gpu_mode(0) == ("exclusive", "1")
    smi(node("Exclusive_Process", "Default", migs=[MIG]), visible)
    assert ev.gpu_mode(0) == ("ok", None)


def test_an_index_among_unlike_gpus_in_cudas_default_order_is_said_to_be_unknown(smi, monkeypatch):
    """CUDA numbers GPUs fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID; nvidia-smi in PCI bus order. On
    unlike GPUs whose modes differ an index cannot be placed: "unknown", naming the exclusive ones, unless
    the order is PCI's, a UUID names the GPU, or every candidate agrees. Breaks if nvidia-smi's index is
    taken for CUDA's (the wrong GPU checked)."""
    names = (H100, "NVIDIA A100-SXM4-80GB", H100)
    for visible in (None, "0", "1,0"):
        smi(node(*DEX, "Default", names=names), visible)
        assert ev.gpu_mode(0) == ("unknown", f"1 ({UUIDS[1]})")
    smi(node(*DEX, "Default", names=names), UUIDS[0])
    assert ev.gpu_mode(0) == ("ok", None)
    smi(node("Exclusive_Process", "Exclusive_Process", "Exclusive_Thread", names=names), "1")
    assert ev.gpu_mode(0) == ("exclusive", "0, 1, 2")  # whichever it is, it is exclusive
    smi(node("Default", "Default", "Default", names=names), "1")
    assert ev.gpu_mode(0) == ("ok", None)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    for visible, local, verdict in (("1", 0, ("exclusive", "1")), (None, 0, ("ok", None)),
                                    ("2,1", 1, ("exclusive", "1"))):
        smi(node(*DEX, "Default", names=names), visible)
        assert ev.gpu_mode(local) == verdict


@pytest.mark.parametrize("pipe", ["env", "default"])
def test_exclusive_gpus_with_an_mps_daemon_go_ahead_saying_so(smi, monkeypatch, tmp_path, capsys, pipe):
    """EXCLUSIVE_PROCESS with an MPS control daemon (its control pipe in CUDA_MPS_PIPE_DIRECTORY, else in
    /tmp/nvidia-mps): MPS clients share its server's context, so the judge's process can start; the run goes
    ahead, with one line that says so. Breaks if the run is refused."""
    where = tmp_path / "mps"
    where.mkdir()
    (where / "control").touch()
    if pipe == "env":
        monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(where))
    else:
        monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY")
        monkeypatch.setattr(ev, "MPS_PIPE_DIRECTORY", str(where))
    smi(node(*DEX), "1")
    assert ev.gpu_mode(0) == ("mps", f"1 (MPS pipe {where})")
    monkeypatch.setattr(ev, "gather", lambda x: [x])
    a = argparse.Namespace(out="runs/x", judge="J")
    ev.refuse_exclusive_gpus(a, 0, torch.device("cuda", 0))
    (line,) = capsys.readouterr().err.splitlines()
    assert "EXCLUSIVE_PROCESS" in line and "MPS control daemon" in line and "going ahead" in line


@pytest.mark.parametrize("broken", ["absent", "failing"])
def test_without_a_working_nvidia_smi_the_judge_goes_ahead(smi, monkeypatch, tmp_path, broken):
    smi({**node(*DEX), "exit": 9}, "1")
    if broken == "absent":
        monkeypatch.setenv("PATH", str(tmp_path))
    assert ev.gpu_mode(0) == ("ok", None)


def test_the_refusals_name_the_gpus_and_the_ways_out(smi, monkeypatch):
    """Every rank's verdict is gathered: any exclusive GPU stops every rank, named by nvidia-smi's index; an
    unknown order stops them too, with the fix (CUDA_DEVICE_ORDER=PCI_BUS_ID or UUIDs)."""
    a = argparse.Namespace(out="runs/x", judge="J")
    monkeypatch.setattr(ev, "gather", lambda x: [("ok", None), ("exclusive", "1"), ("exclusive", "3")])
    with pytest.raises(SystemExit) as stop:
        ev.refuse_exclusive_gpus(a, 0, torch.device("cpu"))
    assert "GPU(s) 1, 3 are in EXCLUSIVE_PROCESS compute mode" in str(stop.value)
    assert "nvidia-smi -c DEFAULT" in str(stop.value)
    assert "--judge-only --out runs/x --judge J" in str(stop.value)
    monkeypatch.setattr(ev, "gather", lambda x: [("unknown", f"1 ({UUIDS[1]})"), ("ok", None)])
    with pytest.raises(SystemExit) as stop:
        ev.refuse_exclusive_gpus(a, 0, torch.device("cpu"))
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in str(stop.value) and UUIDS[1] in str(stop.value)
    with pytest.raises(SystemExit) as stop:
        ev.refuse_exclusive_gpus(a, 1, torch.device("cpu"))
    assert stop.value.code == 1  # the other ranks exit quietly
