"""The CPU toy learns: a shortened run of examples/toy.py (120 of its 600 steps)."""
import json
import os

import pytest
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import toy  # noqa: E402

pytestmark = pytest.mark.slow  # the fast tier, pytest -m "not slow", leaves these out


def test_toy_learns_in_a_shortened_run(tmp_path, capsys):
    """The sampled accuracy of training (5,120 samples in each 20 steps) rises, and the greedy held-out
    accuracy with it. The warm start's held-out figure moves with the CPU's float kernels (20 problems,
    0.05 each): 0.30 on an AVX-512 machine, 0.45 on an AVX2 one, 0.35 to 0.45 when its initial weights
    move by 1e-6; so it is bounded, not pinned. Measured here (AVX2): 0.42 -> 0.66 in training, 0.45 ->
    0.65 held out."""
    before, after = toy.main(["--out", str(tmp_path), "--steps", "120"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"toy: accuracy {before:.2f} -> {after:.2f}"
    assert 0 <= before <= 0.5          # the warm start knows the format, and at most half of the sums
    accuracy = [json.loads(line)["accuracy"] for line in open(tmp_path / "rl" / "metrics.jsonl")]
    first, last20 = sum(accuracy[:20]) / 20, sum(accuracy[-20:]) / 20
    assert last20 >= first + 0.15, (first, last20)  # no learning, or a sign flipped, stays put or falls
    assert after > before              # and it carries to problems it never trained on
    assert os.path.exists(tmp_path / "rl" / "model" / "config.json")


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


def test_hard_toy_problems_and_answers(tmp_path):
    """--hard: 200 problems with the first addend up to 19, 40 held out and never trained on; the answer
    restates the sum before the box, and only the box is graded, so a slip in the restatement still
    scores +1 (the room a spurious token needs). The default toy keeps its 80/20 split of a, b < 10."""
    from reward import score
    train, held_out = toy.problems(hard=True)
    assert (len(train), len(held_out)) == (160, 40)
    assert not {r["problem"] for r in train} & {r["problem"] for r in held_out}
    assert max(r["a"] for r in train + held_out) == 19 and max(r["b"] for r in train + held_out) == 9
    row = next(r for r in train if (r["a"], r["b"]) == (12, 5))
    assert toy.target(row, hard=True) == "12 + 5 = 17, so the answer is \\boxed{17}"
    assert toy.target(row, hard=False) == "\\boxed{17}"
    assert score("12 + 6 = 17, so the answer is \\boxed{17}", row["answer"]) == 1
    assert score("12 + 5 = 17, so the answer is \\boxed{18}", row["answer"]) == -1
    easy_train, easy_held_out = toy.problems()
    assert (len(easy_train), len(easy_held_out)) == (80, 20)
    assert max(r["a"] for r in easy_train + easy_held_out) == 9
    tok = toy.build_tokenizer(str(tmp_path / "tok"), hard=True)
    assert tok.decode(tok(toy.target(row, hard=True))["input_ids"]) == toy.target(row, hard=True)
    assert "1" in tok.tokenize("17") and "7" in tok.tokenize("17")  # one token per digit


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
