"""The README's loss contract for a trainer of your own: the statements tests/test_core.py does not cover
(detached inputs, gradient accumulation, data-parallel scaling under a gradient-averaging wrapper)."""
import os, subprocess, sys

import pytest
import torch

import contract_ddp
from stapo_core import s2t_mask, stapo_loss
from test_core import _batch as core_batch

HERE = os.path.dirname(os.path.abspath(__file__))


def _batch(seed=0):
    return core_batch(seed, n=8, t=7, depth=8, noise=0.3)


def test_gradient_flows_only_through_logp():
    """old_logp and adv are detached inside: given with requires_grad, they get no gradient."""
    logp, old, adv, valid = _batch()
    old.requires_grad_()
    adv.requires_grad_()
    loss, _ = stapo_loss(logp, old, adv, valid)
    loss.backward()
    assert old.grad is None and adv.grad is None and logp.grad.abs().sum() > 0


def test_accumulation_passes_the_steps_count_to_every_micro_batch():
    """Gradient accumulation: the micro-batches' losses, each divided by the step's kept count, sum to the
    step's loss and gradient; each micro-batch's own count (the default) gives another gradient, and a
    wrapper that divides by the number of micro-batches again gives half of it."""
    logp, old, adv, valid = _batch(1)
    keep = valid & ~s2t_mask(logp.detach(), torch.rand(logp.shape), adv, valid, tau_p=0.5)
    whole, _ = stapo_loss(logp, old, adv, keep)
    (want,) = torch.autograd.grad(whole, logp)
    rows = [slice(0, 3), slice(3, 8)]

    def accumulated(num_tokens, divide=1):
        parts = [stapo_loss(logp[r], old[r], adv[r], keep[r], num_tokens=num_tokens)[0] for r in rows]
        loss = sum(parts) / divide
        return loss, torch.autograd.grad(loss, logp)[0]

    loss, got = accumulated(keep.sum())
    torch.testing.assert_close(loss, whole.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert not torch.allclose(accumulated(None)[1], want)  # each micro-batch's own count
    torch.testing.assert_close(accumulated(keep.sum(), divide=2)[1], want / 2)


@pytest.mark.slow
def test_ddp_averaging_needs_num_tokens_over_the_world_size(tmp_path):
    """Two processes under DDP (torchrun, gloo), which averages gradients: num_tokens = global kept / W, or
    the loss times W, gives the one-process gradient of the whole batch (with one tau_h over both ranks);
    the global count as it is gives half of it, and each rank's own tau_h another gradient (11 tokens
    silenced instead of 12). tests/contract_ddp.py is the two processes' side."""
    tokens, old, adv, valid = contract_ddp.data()
    want = contract_ddp.step_grad(contract_ddp.Policy(), tokens, old, adv, valid, 1, "global")
    out = tmp_path / "grads.pt"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    os.path.join(HERE, "contract_ddp.py"), str(out)],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    got = torch.load(out)
    torch.testing.assert_close(got["global/W"], want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got["loss*W"], want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got["global"], want / 2, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(got["per-rank tau_h"], want, rtol=1e-3)
