"""The CPU toy learns: a shortened run of examples/toy.py, and its parts."""
import json
import os

import pytest
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import toy  # noqa: E402

pytestmark = pytest.mark.slow  # the fast tier, pytest -m "not slow", leaves these out
# The shortened run, and the least rise it must show (docs/toy.md: the test). At 100 steps, seed 0, one thread,
# measured under the three kernel settings (native AVX-512, ATEN_CPU_CAPABILITY=avx2, =default): training's
# rise 0.212, 0.326, 0.255; held-out 0.405 -> 0.75, 0.405 -> 0.85, 0.38 -> 0.805. Over the 15 runs of docs/toy.md's
# kernel table (seeds 0-4) the rise at 100 steps is 0.153 or more; at 60 it was 0.077 to 0.205, below 0.1 on
# one (native, seed 2) and 0.114 on the test's own (native, seed 0).
RL_STEPS, RISE = 100, 0.1


def test_toy_learns_in_a_shortened_run(tmp_path, capsys):
    """A shortened run of the toy (its warm start, then RL_STEPS of its STEPS): the warm start knows at most
    half of the 200 held-out sums, RL raises training's sampled accuracy (its last 20 steps over its first 20)
    and the held-out greedy accuracy, and the run prints its S2T summary and the path of its curves before the
    accuracy line. The margins were measured under the three kernel settings of docs/toy.md's table (see
    RL_STEPS)."""
    before, after = toy.main(["--out", str(tmp_path), "--steps", str(RL_STEPS)])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"toy: accuracy {before:.2f} -> {after:.2f}"
    assert out[-2] == "held-out accuracy: greedy, on the 200 problems never trained on"
    assert out[-3] == f"the run's curves: {tmp_path / 'curves.png'}"
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    summary = next(line for line in out if line.startswith("S2T silenced "))
    assert " response tokens (" in summary and "steps; each is in" in summary
    assert 0 <= before <= 0.5          # the warm start knows the format, and at most half of the sums
    accuracy = [json.loads(line)["accuracy"] for line in open(tmp_path / "rl" / "metrics.jsonl")]
    first, last20 = sum(accuracy[:20]) / 20, sum(accuracy[-20:]) / 20
    assert last20 >= first + RISE, (first, last20)  # no learning, or a sign flipped, stays put or falls
    assert after >= before + RISE, (before, after)  # and it carries to sums it never trained on
    assert os.path.exists(tmp_path / "rl" / "model" / "config.json")


def test_s2t_summary_names_three_tokens_in_context(tmp_path):
    """The summary's count and fraction come from the run's logs; three tokens (first, middle, last) are
    shown with p, H and the text around them; a method that silences nothing says so."""
    os.makedirs(tmp_path / "rl")
    rows = [{"step": s, "response_len_mean": 10.0, "silenced_frac": 0.0} for s in (1, 2)]
    (tmp_path / "rl" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokens = [{"step": s, "token": t, "p": 0.01, "H": 0.1, "left": "\\boxed{1", "right": "}"}
              for s, t in ((1, "7"), (1, "8"), (2, "9"), (2, "0"))]
    (tmp_path / "rl" / "silenced.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tokens))
    lines = toy.s2t_summary(str(tmp_path / "rl"), "stapo", 64)
    assert lines[0].startswith("S2T silenced 4 of 1280 response tokens (3.1e-03), in 2 of 2 steps")
    assert [line.split("[[")[1][0] for line in lines[1:]] == ["7", "9", "0"]
    assert "p = 0.01, H = 0.1" in lines[1]
    assert "silences nothing" in toy.s2t_summary(str(tmp_path / "rl"), "justrl", 64)[0]


def test_all_four_objectives_from_one_warm_start(tmp_path, capsys):
    """--method all: a row per objective in the table, a run folder each, and their curves in one PNG."""
    import pytest
    pytest.importorskip("matplotlib")
    table = toy.main(["--out", str(tmp_path), "--method", "all", "--steps", "2", "--sft-steps", "5",
                      "--prompts", "8", "--minibatches", "1"])
    assert [row.split(" | ")[0] for row in table[2:]] == ["| stapo", "| justrl", "| grpo", "| entropy20"]
    assert "\n".join(table) in capsys.readouterr().out
    for method in toy.METHODS:
        assert len(open(tmp_path / method / "metrics.jsonl").readlines()) == 2
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_toy_problems_and_answers(tmp_path):
    """700 problems a + b (a < 100, 3 <= b < 10), 200 held out and never trained on, the same with --hard; the
    warm start's slip forgets the carry; --hard restates the sum before the box, and only the box is graded, so
    a slip in the restatement still scores +1 (the room a spurious token needs)."""
    from reward import score
    for hard in (False, True):
        train, held_out = toy.sums(hard=hard)
        assert (len(train), len(held_out)) == (500, 200)
        assert not {r["problem"] for r in train} & {r["problem"] for r in held_out}
        assert {r["a"] for r in train + held_out} == set(range(100))
        assert {r["b"] for r in train + held_out} == set(range(3, 10))
    row = next(r for r in train + held_out if (r["a"], r["b"]) == (12, 5))
    assert toy.target(row, hard=True) == "12 + 5 = 17, so the answer is \\boxed{17}"
    assert toy.target(row, hard=False) == "\\boxed{17}"
    assert [toy.slipped({"a": a, "b": b}) for a, b in ((37, 5), (95, 7), (12, 5))] == ["32", "92", "17"]
    assert toy.target(row, hard=True, answer="18") == "12 + 5 = 18, so the answer is \\boxed{18}"
    assert score("12 + 6 = 17, so the answer is \\boxed{17}", row["answer"]) == 1
    assert score("12 + 5 = 17, so the answer is \\boxed{18}", row["answer"]) == -1
    tok = toy.build_tokenizer(str(tmp_path / "tok"), hard=True)
    assert tok.decode(tok(toy.target(row, hard=True))["input_ids"]) == toy.target(row, hard=True)
    assert tok.tokenize("108") == ["1", "0", "8"]  # one token per digit
    small_train, small_held_out = toy.problems()  # the tests' fixtures warm-start on these, as before
    assert (len(small_train), len(small_held_out)) == (80, 20)
    assert max(r["a"] for r in small_train + small_held_out) == 9


def test_seed_reaches_the_trainer_and_nothing_else_changes(tmp_path, monkeypatch):
    """--seed changes the RL run's seed only (a flag parsed but never passed would make every seed the same
    run); every other trainer flag stays as it was. (The warm start never reads the seed.)"""
    seen = []

    def fake_train(args):
        seen.append(vars(args))
        os.makedirs(args.out, exist_ok=True)
        open(os.path.join(args.out, "metrics.jsonl"), "w").write('{"step": 1}\n')

    monkeypatch.setattr(toy.stapo, "train", fake_train)
    for seed in (0, 3):
        a = toy.argparse.Namespace(out=str(tmp_path), steps=1, prompts=8, minibatches=1, lr=1e-3, max_tokens=8,
                                   seed=seed, reward="equiv")
        toy.train_one(a, "stapo", "base", str(tmp_path / str(seed)))
    assert (seen[0]["seed"], seen[1]["seed"]) == (0, 3)
    assert {k: v for k, v in seen[0].items() if k not in ("seed", "out")} == \
        {k: v for k, v in seen[1].items() if k not in ("seed", "out")}


def test_a_second_toy_run_into_the_same_out_is_refused_before_the_warm_start(tmp_path, capsys):
    """`bash toy.sh` twice: the second is refused at once, naming what the folder holds and another --out (a
    refusal left to the trainer would come after the warm start, and suggest --resume, which the toy lacks)."""
    os.makedirs(tmp_path / "rl")
    (tmp_path / "rl" / "metrics.jsonl").write_text('{"step": 3}\n')
    with pytest.raises(SystemExit):
        toy.main(["--out", str(tmp_path), "--steps", "1"])
    assert "rl/ holds a run: metrics.jsonl logged to step 3" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["rl"]  # no warm start, no train.jsonl


def test_compare_interval_and_entropy_rise():
    """examples/toy_compare.py: the 95% t-interval over seeds, and the entropy rise (the largest rise of the
    10-step mean above its lowest value before it; 0 for a run whose entropy only falls)."""
    import toy_compare
    mean, half = toy_compare.interval([0.8, 0.9, 1.0, 0.9, 0.9])
    assert abs(mean - 0.9) < 1e-12 and abs(half - 2.7764451 * (0.005 ** 0.5) / 5 ** 0.5) < 1e-8
    assert toy_compare.interval([0.5]) == (0.5, None)
    falling = [{"entropy_mean": 1.0 - i / 100} for i in range(50)]
    assert toy_compare.entropy_rise(falling) == 0
    blow_up = falling + [{"entropy_mean": 0.51 + 0.5}] * 10  # from about 0.5 up to 1.01, held for 10 steps
    low = sum(1.0 - i / 100 for i in range(40, 50)) / 10
    assert abs(toy_compare.entropy_rise(blow_up) - (1.01 - low)) < 1e-9
    rows = {"stapo": {0: {"acc": 0.9}, 1: {"acc": 0.8}, 2: {"acc": 1.0}},
            "justrl": {0: {"acc": 0.7}, 1: {"acc": 0.8}, 2: {"acc": 0.9}}}
    lines = toy_compare.table(rows, 0.4)
    paired = toy_compare.interval([0.2, 0.0, 0.1])  # seed by seed; unpaired, the interval would be wider
    assert lines[-2] == f"| stapo − justrl, paired by seed | {paired[0]:+.3f} ± {paired[1]:.3f} |"
