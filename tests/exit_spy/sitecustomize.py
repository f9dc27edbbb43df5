"""An exit spy, for tests/test_eval.py, in every Python process started with this folder first on PYTHONPATH
(Python imports sitecustomize at its start). Its exit hook is the process's first, so it runs last, after the
program's own (the reward checker's shuts its workers down): it prints to stderr whether torch's default
process group is still alive and how many child processes are still running. Either alive at exit made the
CLIs abort now and then under load ('terminate called without an active exception'); here both are seen on
every exit, loaded or not. Nothing else changes.
"""
import atexit
import os
import sys


def said_at_exit():
    dist = getattr(sys.modules.get("torch"), "distributed", None)
    group = bool(dist and dist.is_available() and dist.is_initialized())
    children = []
    for task in os.listdir("/proc/self/task"):  # a thread's children are listed under the thread
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                children += f.read().split()
        except OSError:  # the thread is gone
            pass
    print(f"exit spy: process group alive: {group}; child processes alive: {len(children)}", file=sys.stderr,
          flush=True)


atexit.register(said_at_exit)
