"""An all-reduce spy, for tests/test_multinode.py, in every Python process started with this folder first on
PYTHONPATH (Python imports sitecustomize at its start): it counts the gradient all-reduces FSDP2 makes across
HSDP's replicas (torch.distributed.all_reduce called from FSDP's foreach_reduce) and prints the count on
stderr at the process's exit. Nothing else changes.
"""
import atexit
import sys

import torch.distributed as dist

real_all_reduce, count = dist.all_reduce, [0]


def all_reduce(*args, **kwargs):
    if sys._getframe(1).f_code.co_name == "foreach_reduce":
        count[0] += 1
    return real_all_reduce(*args, **kwargs)


dist.all_reduce = all_reduce
atexit.register(lambda: count[0] and print(f"all-reduce spy: {count[0]} gradient all-reduces across replicas",
                                           file=sys.stderr, flush=True))
