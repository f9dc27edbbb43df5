"""Several nodes, simulated on this machine: the README's and docs/gpu.md's two-node command, as written (torchrun's
c10d rendezvous, which assigns the node ranks), with 127.0.0.1 for the first node's address. HSDP (shard within a
node, replicate across nodes) trains what one process trains, all-reducing the gradients across nodes once per
update; a shared --out checkpoints and resumes; separate --out folders (node-local disks) fail at once, on every
rank, never hang, with one line."""
import json
import os
import shlex

import pytest
import socket
import subprocess
import sys

from support import args_for, assert_same_metrics, assert_same_params, load_params, metrics_of

import stapo

pytestmark = pytest.mark.slow  # the fast tier, pytest -m "not slow", leaves these out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def documented_command():
    """The two-node command the README and docs/gpu.md give (one and the same), as argv: torchrun's flags up to
    stapo.py, then its flags."""
    commands = []
    for page in ("README.md", os.path.join("docs", "gpu.md")):
        text = open(os.path.join(ROOT, page)).read().replace("\\\n", " ")
        commands += [line.split("#")[0].strip() for line in text.splitlines() if "torchrun --nnodes 2" in line]
    assert len(commands) >= 2 and len(set(commands)) == 1, commands
    return shlex.split(commands[0])


def test_the_documented_two_node_command_lets_torchrun_assign_the_node_ranks():
    """The command names a rendezvous that assigns node ranks (c10d) or spells --node-rank out. Breaks with
    torchrun's default static rendezvous and no --node-rank, where both nodes claim node 0."""
    argv = documented_command()
    flags = argv[:argv.index("stapo.py")]
    assert "--node-rank" in flags or flags[flags.index("--rdzv-backend") + 1] == "c10d", flags
    assert {"--nnodes", "--rdzv-endpoint", "--rdzv-id"} <= set(flags), flags


def nodes(argv_of_node, per_node, timeout=600, **env):
    """Two torchrun "nodes" of per_node processes each, launched with the documented command (its address
    127.0.0.1 and a free port, its process count per_node, stapo.py's flags the test's): the results of each."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = documented_command()
    launcher = command[:command.index("stapo.py")]
    launcher[launcher.index("--nproc-per-node") + 1] = str(per_node)
    launcher[launcher.index("--rdzv-endpoint") + 1] = f"127.0.0.1:{port}"
    launcher = [sys.executable, "-m", "torch.distributed.run", *launcher[1:]]  # torchrun, of this Python
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    procs = [subprocess.Popen([*launcher, os.path.join(ROOT, "stapo.py"), *argv_of_node(r)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
        return [(p.returncode, *o) for p, o in zip(procs, outputs)]
    finally:
        for p in procs:
            p.kill()


def test_two_nodes_of_two_train_as_one_process_and_resume_on_a_shared_out(tiny, tmp_path):
    """2 nodes x 2 ranks (a 2 x 2 HSDP mesh) train 2 steps and checkpoint; 2 nodes x 1 rank resume for a third.
    The model and every metric equal one process's, the final model is written once, each step logged once.
    Each rank's micro-batches are one sample each, and the gradients cross the nodes once per update and FSDP
    group, after the last micro-batch (an all-reduce spy counts them): 4 updates x 3 groups (2 layers, the
    root). Breaks with FSDP2's default, an all-reduce after every micro-batch."""
    d, _ = tiny
    common = ("--prompts-per-step", "8", "--tau-p", "0.9", "--save-every", "2", "--micro-tokens", "64")
    stapo.train(stapo.get_args(args_for(d, tmp_path / "one", "--steps", "3", *common)))
    shared = args_for(d, tmp_path / "two", "--steps", "2", *common)
    spy = os.path.join(ROOT, "tests", "allreduce_spy")
    for code, out, err in nodes(lambda r: shared, per_node=2, PYTHONPATH=spy):
        assert code == 0, err[-3000:]
        assert err.count("all-reduce spy: 12 gradient all-reduces across replicas") == 2, err[-3000:]
    assert sorted(os.listdir(tmp_path / "two" / "ckpt")) == ["step_2"]
    assert json.load(open(tmp_path / "two" / "config.json"))["mesh"] == [2, 2]  # (nodes: replicate, ranks: shard)
    for code, out, err in nodes(lambda r: shared[:-10] + ["--steps", "3", *common, "--resume"], per_node=1):
        assert code == 0, err[-3000:]
    assert_same_params(load_params(tmp_path / "one" / "model"), load_params(tmp_path / "two" / "model"))
    # Four ranks sum in another order than one process, and Adam divides by the root of small second
    # moments: by step 3 (after the resume) grad_norm is 1.0e-4 apart and every other metric within 6e-5
    # (measured, AVX2). A wrong reduction over either mesh dimension moves them by percents.
    assert_same_metrics(metrics_of(tmp_path / "one"), metrics_of(tmp_path / "two"), rel=1e-3)
    assert json.load(open(tmp_path / "two" / "config.json"))["mesh"] == [2, 1]
    assert json.load(open(tmp_path / "one" / "config.json"))["mesh"] == [1]
    assert sorted(os.listdir(tmp_path / "two" / "ckpt" / "step_2" / "dcp")).count(".metadata") == 1


def test_separate_out_folders_fail_at_once_on_every_rank(tiny, tmp_path):
    """Node-local disks: each node's --out is its own folder. Every rank stops at the start, before any
    training, with exit code 2 and no traceback (a user's error), rank 0 saying why in one line; none waits for
    a collective that will never come. The property is where they stop (no step logged), not how long it took:
    a rank left waiting is caught by nodes()'s timeout, a hang guard. Breaks with a traceback on every
    rank (a RuntimeError where a UserError belongs)."""
    d, _ = tiny
    results = nodes(lambda r: args_for(d, tmp_path / f"node{r}", "--steps", "2", "--save-every", "1"), per_node=1,
                    timeout=300)
    for code, out, err in results:  # a user's error: exit code 2, no traceback of ours
        assert code != 0 and "exitcode  : 2" in err and "stapo.py\", line" not in err, err[-3000:]
    said = [line for line in results[0][2].splitlines() if "cannot see what rank 0 wrote there" in line]
    assert len(said) == 1 and "rank(s) [1]" in said[0] and "every node sees" in said[0]  # one line, rank 0's
    for node in ("node0", "node1"):
        assert not os.path.exists(tmp_path / node / "metrics.jsonl")
