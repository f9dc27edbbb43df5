"""A judge process killed midway: eval.py's judge process (--judge-shard) judging 2 samples at a time, killed
with SIGKILL (no clean-up, as the OOM killer or a scheduler does) inside its judge call after N calls.
Run by tests/test_eval.py.

    python tests/judge_crash.py N --judge-shard 0/1 --out OUT --judge MODEL [eval.py's flags]
"""
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import eval as ev  # noqa: E402
from parallel import run_program  # noqa: E402  as eval.py's own __main__: it ends the process group


def main(after, argv):
    ev.JUDGE_CHUNK = 2
    real, calls = ev.judge, []

    def judge(*args, **kwargs):
        if len(calls) == after:
            os.kill(os.getpid(), signal.SIGKILL)
        calls.append(len(args[0]))
        return real(*args, **kwargs)
    ev.judge = judge
    ev.main(argv)


if __name__ == "__main__":
    run_program(lambda: main(int(sys.argv[1]), sys.argv[2:]))
