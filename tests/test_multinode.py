"""Several nodes, simulated on this machine: torchrun --nnodes 2 --node-rank 0|1 with a static rendezvous on
127.0.0.1. HSDP (shard within a node, replicate across nodes) trains what one process trains; a shared --out
checkpoints and resumes; separate --out folders (node-local disks) fail at once, on every rank, never hang."""
import json
import os

import pytest
import socket
import subprocess
import sys

from test_trainer import args_for, assert_same_metrics, assert_same_params, load_params, metrics_of

import stapo

pytestmark = pytest.mark.slow  # the fast tier, pytest -m "not slow", leaves these out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nodes(argv_of_node, per_node, timeout=600):
    """Two torchrun "nodes" of per_node processes each; returns their CompletedProcess-like results."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(r),
                               "--nproc-per-node", str(per_node), "--rdzv-endpoint", f"127.0.0.1:{port}",
                               os.path.join(ROOT, "stapo.py"), *argv_of_node(r)],
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
    The model and every metric equal one process's, the final model is written once, each step logged once."""
    d, _ = tiny
    common = ("--prompts-per-step", "8", "--tau-p", "0.9", "--save-every", "2")
    stapo.train(stapo.get_args(args_for(d, tmp_path / "one", "--steps", "3", *common)))
    shared = args_for(d, tmp_path / "two", "--steps", "2", *common)
    for code, out, err in nodes(lambda r: shared, per_node=2):
        assert code == 0, err[-3000:]
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
    """Node-local disks: each node's --out is its own folder. Every rank stops with the reason, at the start,
    before any training; none waits for a collective that will never come. The property is where they stop
    (the check's message on every rank, no step logged), not how long it took: a rank left waiting is caught
    by nodes()'s timeout, a hang guard."""
    d, _ = tiny
    results = nodes(lambda r: args_for(d, tmp_path / f"node{r}", "--steps", "2", "--save-every", "1"), per_node=1,
                    timeout=300)
    for code, out, err in results:
        assert code != 0
        assert "rank(s) [1] cannot see what rank 0 wrote there" in err and "every node sees" in err, err[-3000:]
    for node in ("node0", "node1"):
        assert not os.path.exists(tmp_path / node / "metrics.jsonl")
