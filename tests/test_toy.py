"""The CPU toy learns: a shortened run of examples/toy.py, and its parts."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import toy  # noqa: E402
from parallel import UserError  # noqa: E402
from support import tree_hashes  # noqa: E402

pytestmark = pytest.mark.slow  # the fast tier, pytest -m "not slow", leaves these out
# The shortened run, and the least rise it must show (docs/toy.md: the test).
RL_STEPS, RISE, IN_SPAN = 60, 0.1, 0.8


def test_the_toy_runs_stapo_beside_justrl_and_s2t_falls_in_the_span(tmp_path, capsys):
    """What `bash toy.sh` shows, shortened to RL_STEPS of its RL (its warm start whole): the two arms run from one
    warm start, side by side, and the output ends with the share line and one accuracy line per arm. STAPO learns:
    its training accuracy over the last 20 steps beats the first 20 by RISE, and its held-out accuracy the warm
    start's. And the paper's premise holds by construction: under both objectives S2T's set falls mostly
    (IN_SPAN) in the span the reward ignores, STAPO applies none of its gradient and JustRL some. Breaks if the
    toy stops learning (or a sign flips), if the span loses its label noise or the box its grading (the set
    would move to the box or vanish), if the arms swap or share a run folder."""
    results = toy.main(["--out", str(tmp_path), "--steps", str(RL_STEPS)])
    out = capsys.readouterr().out.strip().splitlines()
    (b0, a0), (b1, a1) = results["stapo"], results["justrl"]
    assert out[-2:] == [f"toy: stapo accuracy {b0:.2f} -> {a0:.2f}", f"toy: justrl accuracy {b1:.2f} -> {a1:.2f}"]
    assert out[-3].startswith("the silenced tokens: ") and "of JustRL's gradient" in out[-3]
    assert out[-4] == "held-out accuracy: greedy, on the 200 problems never trained on"
    assert "one seed shows a trajectory" in out[-5] and "docs/toy.md" in out[-5]
    assert out[-6] == f"the runs' curves: {tmp_path / 'curves.png'}"
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    assert b0 == b1 and 0 <= b0 <= 0.5    # one warm start; it knows the format, and at most half of the sums
    rows = {arm: [json.loads(x) for x in open(tmp_path / arm / "rl" / "metrics.jsonl")] for arm in toy.PAIR}
    accuracy = [r["accuracy"] for r in rows["stapo"]]
    first, last20 = sum(accuracy[:20]) / 20, sum(accuracy[-20:]) / 20
    assert last20 >= first + RISE, (first, last20)  # no learning, or a sign flipped, stays put or falls
    assert a0 >= b0 + RISE, (b0, a0)                 # and it carries to sums it never trained on
    for arm in toy.PAIR:
        found = [json.loads(x) for x in open(tmp_path / arm / "rl" / "silenced.jsonl")]
        where = toy.regions(found, 8)
        assert len(found) >= 20 and where["span"] >= IN_SPAN * len(found), (arm, where)
        assert {r["silenced"] for r in found} == {arm == "stapo"}
    assert all(r["grad_share/silenced"] in (0, None) for r in rows["stapo"])
    assert toy.grad_share(rows["justrl"]) > 0.001
    assert os.path.exists(tmp_path / "stapo" / "rl" / "model" / "config.json")


def test_one_arm_alone_keeps_its_own_last_line(tmp_path, capsys):
    """--method X runs one arm alone in this process, shortened here (a 5-step warm start, 2 RL steps): its S2T
    summary, its curves and `toy: accuracy A -> B` last; its result.json has the span's figures."""
    before, after = toy.main(["--out", str(tmp_path), "--method", "justrl", "--steps", "2", "--sft-steps", "5"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"toy: accuracy {before:.2f} -> {after:.2f}"
    assert out[-3] == f"the run's curves: {tmp_path / 'curves.png'}"
    assert any(line.startswith("S2T's set under justrl: ") for line in out)
    result = json.load(open(tmp_path / "result.json"))
    assert result["world"] == "span" and result["span_tokens"] == 8
    assert set(result["span"]["after"]) == {"span_entropy", "span_off", "box_entropy"}


def test_s2t_summary_names_three_tokens_in_context_and_where_they_fell(tmp_path):
    """The summary's count and fraction come from the run's logs; where the set fell (span, box, after) is
    counted; three tokens (first, middle, last) are shown with p, H and the text around them; whether the run
    silenced them is said by its objective."""
    os.makedirs(tmp_path / "rl")
    rows = [{"step": s, "response_len_mean": 10.0, "silenced_frac": 0.0} for s in (1, 2)]
    (tmp_path / "rl" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokens = [{"step": 1, "token": "q", "t": 2, "p": 0.01, "H": 0.1, "left": "I add", "right": " and box"},
              {"step": 1, "token": "8", "t": 11, "p": 0.01, "H": 0.1, "left": "the sum: \\boxed{1", "right": "}"},
              {"step": 2, "token": "x", "t": 4, "p": 0.01, "H": 0.1, "left": "I add them and", "right": " the"},
              {"step": 2, "token": "9", "t": 14, "p": 0.01, "H": 0.1, "left": "\\boxed{17}", "right": ""}]
    (tmp_path / "rl" / "silenced.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tokens))
    lines = toy.s2t_summary(str(tmp_path / "rl"), "stapo", 64, span_tokens=8)
    assert lines[0].startswith("S2T's set under stapo: 4 of 1280 response tokens (3.1e-03), in 2 of 2 steps, "
                               "silenced; 2 in the span, 1 in the box, 1 after it;")
    assert [line.split("[[")[1][0] for line in lines[1:]] == ["q", "x", "9"]
    assert "p = 0.01, H = 0.1" in lines[1]
    assert "silences nothing" in toy.s2t_summary(str(tmp_path / "rl"), "justrl", 64)[0]


def test_region_tells_the_span_from_the_box_and_what_comes_after():
    """region(): a span token (before any backslash, within the span's length), a token of the box (its
    opening `\\`, `boxed`, `{`, the digits, the closing brace) and one after the closed box. Breaks if a digit
    of the box or a run-on token counted as the span (the premise would hold by miscounting)."""
    span, box = "I add them and box the sum:", " \\boxed{17}"
    cases = [("I add", " them", 2, "span"), ("I add them and box the sum", ":", 7, "span"),
             (span, " \\", 8, "box"), (span + " \\", "boxed", 9, "box"), (span + " \\boxed", "{", 10, "box"),
             (span + " \\boxed{", "1", 11, "box"), (span + " \\boxed{17", "}", 13, "box"),
             (span + box, " the", 14, "after"), ((span + box)[-40:], "Z", 16, "after"),
             ("\\boxed{17} and then some more words", "x", 30, "after"),
             (" and then some more words, and more words", "x", 30, "after"),  # the box beyond the 40
             ("I \\boxed{", "1", 4, "box")]  # a box inside the span's length is the box
    for left, token, t, want in cases:
        assert toy.region({"left": left[-40:], "token": token, "t": t}, 8) == want, (left, token)
    assert toy.region({"left": "", "token": "\\", "t": 0}, 0) == "box"  # the add world has no span


def test_the_span_is_taught_with_its_label_noise(tmp_path):
    """span_answer: SPAN's 8 tokens, each a letter with probability noise, then the box and the end token; with
    noise 0 exactly the span, and the rate of letters drawn is the noise's. Breaks if the noise were drawn once
    per answer, or never, or the span's tokens were not one per word (the tokenizer's corpus lost the span)."""
    import random
    tok = toy.build_tokenizer(str(tmp_path / "tok"), span=True)
    span = tok(toy.SPAN, add_special_tokens=False)["input_ids"]
    assert len(span) == 8 and tok.decode(span) == toy.SPAN
    clean = toy.span_answer(tok, "17", random.Random(0), 0.0)
    assert tok.decode(clean) == toy.SPAN + " \\boxed{17}<|im_end|>"
    letters = {tok.convert_tokens_to_ids(c) for c in toy.LETTERS}
    rng, n = random.Random(3), 4000
    drawn = [toy.span_answer(tok, "17", rng, 0.05)[:8] for _ in range(n)]
    changed = [x != s for d in drawn for x, s in zip(d, span)]
    assert all(x in letters for d in drawn for x, s in zip(d, span) if x != s)
    assert abs(sum(changed) / len(changed) - 0.05 * (1 - 1 / (8 * 52))) < 0.006  # "I" may draw "I"
    assert sum(any(x != s for x, s in zip(d, span)) for d in drawn) > 0.25 * n  # per token, not per answer
    assert toy.build_tokenizer(str(tmp_path / "add")).tokenize("108") == ["1", "0", "8"]


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
    run); every other trainer flag stays as it was. (The warm start never reads the seed.) The positive control
    is JustRL at CONTROL_LR_FACTOR times the lr with both clips off, and differs from JustRL in nothing else.
    Breaks if the control ran with a clip on, or at the same lr, or as another objective."""
    seen = []

    def fake_train(args):
        seen.append(vars(args))
        os.makedirs(args.out, exist_ok=True)
        open(os.path.join(args.out, "metrics.jsonl"), "w").write('{"step": 1}\n')

    monkeypatch.setattr(toy.stapo, "train", fake_train)
    a = toy.parse(["--out", str(tmp_path), "--steps", "1", "--prompts", "8", "--minibatches", "1", "--lr", "1e-3",
                   "--max-tokens", "8"])[1]
    for seed, arm in ((0, "stapo"), (3, "stapo"), (3, "justrl"), (3, "control")):
        a.seed = seed
        toy.train_one(a, arm, "base", str(tmp_path / f"{arm}{seed}"))
    assert [(s["seed"], s["method"], s["tau_p"]) for s in seen] == [(0, "stapo", 0.002), (3, "stapo", 0.002),
                                                                     (3, "justrl", 0.002), (3, "justrl", 0.002)]
    same = lambda x, y, but: {k: v for k, v in x.items() if k not in but} == \
        {k: v for k, v in y.items() if k not in but}  # noqa: E731
    assert same(seen[0], seen[1], ("seed", "out"))
    control = ("out", "lr", "eps_low", "eps_high", "clip_c", "grad_clip")
    assert same(seen[2], seen[3], control) and seen[3]["lr"] == toy.CONTROL_LR_FACTOR * 1e-3
    assert (seen[3]["eps_low"], seen[3]["eps_high"], seen[3]["clip_c"], seen[3]["grad_clip"]) == (0.999, 1e9, 1e9, 1e9)
    assert (seen[2]["eps_low"], seen[2]["eps_high"], seen[2]["grad_clip"]) == (0.2, 0.28, 1.0)


def test_the_worlds_runs_are_sized_as_docs_toy_md_says():
    """Each world's RL settings, as docs/toy.md gives them: bash toy.sh runs the span world's, and --world add
    the earlier toy unchanged (its committed runs were made with these)."""
    a = toy.parse([])[1]
    assert (a.world, a.method, a.steps, a.lr, a.prompts, a.minibatches, a.tau_p, a.max_tokens) == \
        ("span", "pair", 250, 1e-3, 16, 2, 0.002, 18)
    a = toy.parse(["--world", "add"])[1]
    assert (a.steps, a.lr, a.prompts, a.minibatches, a.tau_p, a.max_tokens) == (350, 5e-4, 32, 2, 0.05, 10)
    assert toy.parse(["--world", "add", "--hard", "--lr", "2e-3"])[1].max_tokens == 24
    with pytest.raises(UserError):
        toy.parse(["--hard"])  # the span world has no --hard


def test_a_second_toy_run_into_the_same_out_is_refused_before_the_warm_start(tmp_path):
    """`bash toy.sh` twice: the second is refused at once, naming what the folder holds, --resume and another
    --out (a refusal left to the trainer would come after the warm start); the same for one arm alone."""
    for argv, run in (([], "justrl/rl"), (["--method", "stapo"], "rl")):
        out = tmp_path / run.replace("/", "_")
        os.makedirs(out / run)
        (out / run / "metrics.jsonl").write_text('{"step": 3}\n')
        with pytest.raises(UserError, match=f"{run}/ holds a run: metrics.jsonl logged to step 3.*--resume"):
            toy.main(["--out", str(out), "--steps", "1"] + argv)
        assert sorted(os.listdir(out)) == [run.split("/")[0]]  # no warm start, no train.jsonl


@contextlib.contextmanager
def toy_process(*argv):
    """examples/toy.py as a user starts it from a terminal: in a session of its own (Ctrl-C reaches its group),
    with Ctrl-C's default disposition (a test run in the background inherits SIGINT ignored, and Python then
    never raises KeyboardInterrupt); killed with its group at the end, whatever the test found."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "examples", "toy.py"), *argv], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def ctrl_c_when(proc, ready, polls=6000):
    """Ctrl-C to the toy's process group once ready() holds (or it ended): (exit code, stdout, stderr)."""
    for _ in range(polls):
        if ready() or proc.poll() is not None:
            break
        time.sleep(0.1)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--tau-p", "2"], "--tau-p 2.0: must be in (0, 1)"),
    (["--hard"], "--hard is the add world's"),
    (["--out", "{tmp}/a_file/run"], "cannot be written"),
])
def test_a_bad_toy_flag_is_one_line_and_nothing_is_written(tmp_path, flags, message):
    """Each bad value is refused in one line, exit code 2, before the warm start, and nothing is written.
    Breaks if a bound is left to the trainer (it says so after the whole warm start), or --out is first
    tried by the warm start's save (a traceback)."""
    (tmp_path / "a_file").write_text("")
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    argv = flags if "--out" in flags else ["--out", str(tmp_path / "run"), *flags]
    with toy_process(*argv) as proc:
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and err.strip().splitlines() == [f"toy.py: error: {err.split('error: ')[1].strip()}"]
    assert message in err
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


def test_ctrl_c_in_the_warm_start_is_one_line_and_leaves_no_base(tmp_path):
    """Ctrl-C while the warm start trains: one line, exit code 130, and no base/ (nor its partial build): a
    later run builds it whole. Breaks if the warm start is built in place (a half-made base/ a --resume would
    take for whole) or the interrupt reaches Python's handler (a long traceback)."""
    with toy_process("--out", str(tmp_path), "--sft-steps", "100000") as proc:
        code, _, err = ctrl_c_when(proc, lambda: os.path.exists(tmp_path / "base.partial" / "config.json"))
    assert code == 130 and err.strip().splitlines() == ["toy.py: stopped by Ctrl-C"]
    assert sorted(os.listdir(tmp_path)) == ["train.jsonl"]


def test_resume_continues_an_interrupted_toy_run(tmp_path):
    """Ctrl-C in the toy's RL (both arms running): one line saying to resume, then the same command with
    --resume keeps the warm start, continues each arm from its checkpoint, and ends as a whole run does: every
    step logged once, in order, and the two accuracy lines. Breaks if --resume is unknown, rebuilds the warm
    start (the arms would start from another model), or restarts an arm (its steps logged twice or from 1)."""
    argv = ["--out", str(tmp_path), "--sft-steps", "5", "--steps", "16", "--no-figure"]
    rows = lambda arm: toy.read_rows(str(tmp_path / arm / "rl" / "metrics.jsonl"))  # noqa: E731
    with toy_process(*argv) as proc:
        code, _, err = ctrl_c_when(proc, lambda: min(len(rows(arm)) for arm in toy.PAIR) >= 3)
    assert code == 130, err
    assert err.strip().splitlines()[-1].endswith("To continue: the same command with --resume")
    stopped = {arm: rows(arm) for arm in toy.PAIR}  # each row has its step's seconds: a rerun's would differ
    assert 3 <= min(map(len, stopped.values())) and max(map(len, stopped.values())) < 16
    base = tree_hashes(tmp_path / "base")
    with toy_process(*argv, "--resume") as proc:
        out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err
    assert out.strip().splitlines()[-2].startswith("toy: stapo accuracy ")
    assert out.strip().splitlines()[-1].startswith("toy: justrl accuracy ")
    assert tree_hashes(tmp_path / "base") == base
    for arm in toy.PAIR:
        assert [r["step"] for r in rows(arm)] == list(range(1, 17)), arm
        assert rows(arm)[:len(stopped[arm])] == stopped[arm], arm  # continued, not run again from step 1


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
    steady = [{"accuracy": 0.2 + i / 100} for i in range(50)]
    assert toy_compare.accuracy_drop(steady) == 0
    crash = steady + [{"accuracy": 0.0}] * 10  # the 10-step mean falls from its top to 0
    top = sum(0.2 + i / 100 for i in range(40, 50)) / 10
    assert abs(toy_compare.accuracy_drop(crash) - top) < 1e-9
