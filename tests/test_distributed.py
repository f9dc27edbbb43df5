"""The trainer across ranks and micro-batches: two ranks, other micro-batches and a tied model train
what one process trains; per-rank shares reduce to one process's thresholds and counts."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import stapo
from support import ROOT, args_for, load_params, assert_same_params, run, assert_same_metrics, metrics_of


@pytest.mark.slow
def test_two_ranks_and_other_micro_batches_equal_one_process(tiny, tmp_path, one_thread):
    """With silencing active (tau_p 0.9) and micro-batches of 64 tokens (the ranks run unequal numbers
    of them), two ranks give the model and every metric of one process; so does one micro-batch per
    mini-batch ("big": the S2T pass is the update's own forward, and mini-batch 0's old log p comes from
    it). A per-rank tau_h, a per-rank denominator, a count summed over ranks twice, or a fused pass that
    leaves mini-batch 0's old log p unset or computes the mask from other values breaks this."""
    d, _ = tiny
    common = ("--steps", "3", "--tau-p", "0.99", "--micro-tokens", "64")  # S2T silences on any CPU kernels
    stapo.train(stapo.get_args(args_for(d, tmp_path / "one", *common)))
    run(args_for(d, tmp_path / "two", *common), nproc=2)
    stapo.train(stapo.get_args(args_for(d, tmp_path / "big", *common[:4], "--micro-tokens", "512")))
    one = load_params(tmp_path / "one" / "model")
    assert_same_params(one, load_params(tmp_path / "two" / "model"))
    assert_same_params(one, load_params(tmp_path / "big" / "model"))
    assert not torch.allclose(one["lm_head.weight"], load_params(d / "model")["lm_head.weight"])  # it trained
    m1 = metrics_of(tmp_path / "one")
    assert sum(x["silenced_frac"] > 0 for x in m1) >= 2 and all(x["candidates"] > 0 for x in m1)  # S2T at work
    assert_same_metrics(m1, metrics_of(tmp_path / "two"))
    assert_same_metrics(m1, metrics_of(tmp_path / "big"))


NAN_LOSS = """
import math, sys
sys.path.insert(0, sys.argv[1])
import parallel, stapo
real = stapo.stapo_loss
stapo.stapo_loss = lambda *a, **k: (lambda loss, st: (loss * math.nan, st))(*real(*a, **k))
parallel.run_program(lambda: stapo.train(stapo.get_args(sys.argv[2:])))
"""


@pytest.mark.slow
def test_a_skipped_update_is_counted_once_on_two_ranks(tiny, tmp_path):
    """Two ranks, every loss NaN: each of the step's 2 updates is skipped on both ranks (the norm is global),
    and skipped_updates counts 2, not 4, with one line for each on stderr (rank 0's). Breaks with the count
    summed over ranks (one skipped update logged as 8 on 8 GPUs)."""
    d, _ = tiny
    (tmp_path / "nan.py").write_text(NAN_LOSS)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(tmp_path / "nan.py"), ROOT, *args_for(d, tmp_path / "out", "--steps", "1")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = metrics_of(tmp_path / "out")
    assert row["skipped_updates"] == 2 and math.isnan(row["grad_norm"])
    assert r.stderr.count("the gradient norm is nan; this update is skipped") == 2


TWO_RANK_WEIGHTS = """
import json, os, sys, torch
sys.path.insert(0, sys.argv[1])
import parallel, stapo
rank, world, _, _ = parallel.init_distributed()
g = torch.Generator().manual_seed(0)
logp, ent = -torch.rand(8, 5, generator=g) * 4, torch.rand(8, 5, generator=g) * 3
adv, valid = torch.randn(8, generator=g), torch.rand(8, 5, generator=g) < 0.8
args = stapo.get_args(["--tau-p", "0.5", "--q", "0.6"])
rows = slice(0, 8) if world == 1 else [slice(0, 2), slice(2, 8)][rank]  # unequal shares
out = {}
s2t = stapo.spurious_tokens(logp[rows], ent[rows], adv[rows], valid[rows], args.tau_p, args.q)
for method in ("stapo", "entropy20", "justrl", "grpo"):
    scale, num_tokens = stapo.token_scales(method, ent[rows], valid[rows], s2t)
    out[method] = {"scale": parallel.gather(scale.float().tolist()), "num_tokens": num_tokens,
                   "tau_h": s2t.tau_h, "candidates": s2t.n_candidates}
if rank == 0:
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
torch.distributed.barrier()  # every rank's work is done
os._exit(0)  # no teardown, as tests/contract_ddp.py ends (a rank once aborted at this script's end in CI)
"""


@pytest.mark.slow
def test_token_scales_on_two_ranks_equal_one_process(tmp_path):
    """Each rank holds a different, unequal share of a mini-batch: the keep mask, the denominator, tau_h
    and the candidate count must be those of one process holding all of it (a per-rank quantile fails)."""
    (tmp_path / "w.py").write_text(TWO_RANK_WEIGHTS)
    run_py = [sys.executable, str(tmp_path / "w.py"), ROOT]
    subprocess.run(run_py + [str(tmp_path / "one.json")], check=True, timeout=300)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    *run_py[1:], str(tmp_path / "two.json")], check=True, timeout=300)
    one, two = (json.load(open(tmp_path / f)) for f in ("one.json", "two.json"))
    for method in one:
        assert sum(two[method]["scale"], []) == one[method]["scale"][0], method
        assert two[method]["num_tokens"] == one[method]["num_tokens"], method
    assert two["stapo"]["tau_h"] == pytest.approx(one["stapo"]["tau_h"]) and one["stapo"]["candidates"] >= 4
    assert 0 < sum(map(sum, one["stapo"]["scale"][0])) < sum(map(sum, one["justrl"]["scale"][0]))  # some silenced


@pytest.mark.slow
def test_a_tied_model_trains_on_one_and_two_ranks_resumes_and_exports_tied(tiny, tmp_path):
    """Qwen3-0.6B, 1.7B and 4B tie their embedding and LM head. Through the HF engine: 1 rank for 2 steps, then
    2 ranks resuming for a third; the export loads in transformers, still tied, and the shared matrix trained."""
    from reference import toy_model
    from transformers import AutoModelForCausalLM
    d, _ = tiny
    toy_model(tmp_path / "tied", tied=True)
    argv = args_for(d, tmp_path / "run", "--model", str(tmp_path / "tied" / "model"), "--save-every", "2",
                    "--tau-p", "0.9", "--weight-decay", "0")  # what moves the weights is the gradient
    stapo.train(stapo.get_args(argv + ["--steps", "2"]))
    run(argv + ["--steps", "3", "--resume"], nproc=2)
    m = metrics_of(tmp_path / "run")
    assert [x["step"] for x in m] == [1, 2, 3] and all(x["grad_norm"] > 0 for x in m)
    before = AutoModelForCausalLM.from_pretrained(tmp_path / "tied" / "model")
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")
    assert after.lm_head.weight is after.model.embed_tokens.weight
    assert not torch.allclose(after.lm_head.weight, before.lm_head.weight)
