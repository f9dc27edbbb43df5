"""A user's mistake ends a program in one line naming the flag, file or line, with exit code 2, before the
policy or the engine is built, and with nothing written; Ctrl-C before a run's first step is one line too."""
import json
import os
import subprocess
import sys

import pytest

import eval as ev
import parallel
import stapo
from support import ROOT, args_for


def run_main(main, capsys):
    """main() as a program runs it (parallel.run_program): (exit code, the non-empty lines on stderr)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        parallel.run_program(main)
    return stop.value.code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.fixture
def nothing_built(monkeypatch):
    """The policy and the engine must not be reached: building either fails the test."""
    def built(*args, **kwargs):
        raise AssertionError("built before the error was found")
    monkeypatch.setattr(stapo, "build_policy", built)
    monkeypatch.setattr(stapo, "make_engine", built)


def bad_inputs(tmp):
    """{the message's gist: (stapo.py's extra flags, what to set up)} for the inputs users met as tracebacks."""
    (tmp / "empty.jsonl").write_text("")
    (tmp / "data.csv").write_text("problem,answer\nWhat is 1 + 1?,2\n")
    return {
        "holds no problems": ["--dataset", str(tmp / "empty.jsonl")],
        "every one of its 80 prompts is longer than --max-prompt-len 5 tokens": ["--max-prompt-len", "5"],
        "--group-size 1: must be at least 2": ["--group-size", "1"],
        "a .jsonl or .parquet file is read": ["--dataset", str(tmp / "data.csv")],
        "--out /proc/stapo_run: cannot be written": ["--out", "/proc/stapo_run"],
        "--temperature 0.0: must be above 0": ["--temperature", "0"],
        "--steps 0: must be at least 1": ["--steps", "0"],
        "--dataset /no/such.jsonl: no such file": ["--dataset", "/no/such.jsonl"],
        "--eval-benchmarks: unknown ['aime2024']": ["--eval-every", "1", "--eval-benchmarks", "aime2024"],
    }


@pytest.mark.parametrize("gist", ["holds no problems", "every one of its 80 prompts", "--group-size 1",
                                  "a .jsonl or .parquet file", "--out /proc/stapo_run", "--temperature 0.0",
                                  "--steps 0", "--dataset /no/such.jsonl", "--eval-benchmarks"])
def test_a_bad_input_is_one_line_before_anything_is_built_and_nothing_is_written(tiny, tmp_path, capsys,
                                                                                 nothing_built, gist):
    """Each input that a user's trial met as a traceback (some of them after the model and the first rollout):
    exit code 2, one line holding the message, no policy or engine built, --out not made. Breaks if a check
    moves after the build (the fixture fails it), or an error escapes as a traceback."""
    d, _ = tiny
    cases = bad_inputs(tmp_path)
    message = next(m for m in cases if m.startswith(gist))
    out = tmp_path / "out"
    argv = args_for(d, out, *cases[message])
    code, lines = run_main(lambda: stapo.train(stapo.get_args(argv)), capsys)
    assert code == 2 and len(lines) == 1 and message in lines[0], (code, lines)
    assert not out.exists()


def test_report_to_a_package_not_installed_is_one_line(tiny, tmp_path, capsys, nothing_built, monkeypatch):
    """--report-to wandb or tensorboard without the package: one line naming what to install, before anything is
    built. Breaks if the import waits for the Reporter (after the model load)."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it raises ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    for kind, package in (("wandb", "wandb"), ("tensorboard", "tensorboard")):
        argv = args_for(tiny[0], tmp_path / kind, "--report-to", kind)
        code, lines = run_main(lambda: stapo.train(stapo.get_args(argv)), capsys)
        assert code == 2 and lines == [f"{sys.argv[0].split('/')[-1]}: error: --report-to {kind} needs the "
                                       f"{package} package: pip install {package}"], lines
        assert not (tmp_path / kind).exists()


def test_ctrl_c_before_the_first_step_is_one_line(tiny, tmp_path, capsys, monkeypatch):
    """Ctrl-C while the model loads (before the trainer's own handler, which stops at a step's end): one line,
    exit code 130, no traceback. Breaks if KeyboardInterrupt reaches Python's handler (a long traceback)."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(stapo, "build_policy", interrupted)
    argv = args_for(tiny[0], tmp_path / "out")
    code, lines = run_main(lambda: stapo.train(stapo.get_args(argv)), capsys)
    assert code == 130 and len(lines) == 1 and "stopped by Ctrl-C" in lines[0], lines


def test_eval_compare_of_folders_without_results_is_one_line(tmp_path, capsys):
    """eval.py --compare A B where a folder holds no results.json: one line naming it. Breaks with a
    FileNotFoundError traceback."""
    done = tmp_path / "done"
    done.mkdir()
    (done / "results.json").write_text(json.dumps({"table": {"aime24": {"avg@k": 10.0}}}))
    for a, b, missing in ((done, tmp_path / "nope", "nope"), (tmp_path / "nope", done, "nope")):
        code, lines = run_main(lambda: ev.main(["--compare", str(a), str(b)]), capsys)
        assert code == 2 and len(lines) == 1 and f"{tmp_path / missing} holds no results.json" in lines[0], lines


@pytest.mark.parametrize("flags, message", [(["--out", "/proc/stapo_eval"], "--out /proc/stapo_eval: cannot be written"),
                                            (["--samples", "0"], "--samples 0: must be at least 1"),
                                            (["--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]")])
def test_eval_refuses_a_bad_flag_in_one_line_before_any_model_is_read(tiny, capsys, monkeypatch, flags, message):
    """eval.py's numbers and --out are checked before the tokenizer or an engine is built. Breaks if a check
    waits for the model (the engine builder fails the test)."""
    def built(*args, **kwargs):
        raise AssertionError("an engine was built before the error was found")
    monkeypatch.setattr(ev, "make_engine", built)
    code, lines = run_main(lambda: ev.main(["--model", str(tiny[0] / "model"), *flags]), capsys)
    assert code == 2 and len(lines) == 1 and message in lines[0], lines


@pytest.mark.slow
def test_a_users_error_is_one_line_and_exit_code_2(tiny, tmp_path, capsys):
    """A wrong flag value, a missing model folder, a malformed dataset line and a used --out each end the run with
    one line naming the flag, file or line, exit code 2 and no traceback; under torchrun rank 0 alone prints it
    (torchrun's own report of the failed workers follows). The single-process cases run through stapo.py's own
    main (parallel.run_program over train) in this process; the torchrun case is real processes. Breaks with a
    traceback before the message (an exception left to Python), a message from every rank, or another exit
    code."""
    d, _ = tiny
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "What is 1 + 1?", "answer": "2"}\nnot json\n')
    used = tmp_path / "used"
    used.mkdir()
    (used / "metrics.jsonl").write_text('{"step": 3}\n')
    cases = {"--prompts-per-step 4 must split evenly into --minibatches 3": ["--minibatches", "3"],
             "--model /nonexistent/model: no such folder": ["--model", "/nonexistent/model"],
             f"{bad}:2: not valid JSON": ["--dataset", str(bad)],
             f"--out {used} already holds a run: metrics.jsonl logged to step 3": ["--out", str(used)],
             "argument --lr: invalid float value: 'fast'": ["--lr", "fast"]}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for message, flags in cases.items():
        argv = args_for(d, tmp_path / "out", *flags)
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            parallel.run_program(lambda: stapo.train(stapo.get_args(argv)))  # stapo.py's __main__
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert stop.value.code == 2 and len(lines) == 1 and message in lines[0], (message, stop.value.code, lines)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        os.path.join(ROOT, "stapo.py"), *args_for(d, tmp_path / "out2", "--dataset", str(bad))],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode != 0 and r.stderr.count(f"{bad}:2: not valid JSON") == 1, r.stderr[-3000:]
    assert "stapo.py\", line" not in r.stderr and "exitcode  : 2" in r.stderr  # no trace of ours; torchrun's report
