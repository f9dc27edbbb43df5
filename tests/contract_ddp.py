"""Helper for tests/test_contract.py: one STAPO step under DDP with each way of scaling num_tokens.

    torchrun --standalone --nproc_per_node 2 tests/contract_ddp.py OUT.pt

Rank 0 holds rows 0-2 of the batch, rank 1 rows 3-7; rank 0 saves {scale: gradient after DDP} to OUT.pt.
"""
import os, sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from stapo_core import s2t_candidates, s2t_mask, s2t_threshold, stapo_loss  # noqa: E402

SCALES = ("global/W", "loss*W", "global", "per-rank tau_h")


class Policy(torch.nn.Module):
    """log p of each sampled token from one table of logits per position: [N, T] with a gradient."""

    def __init__(self, t=7, v=600):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.randn(t, v, generator=torch.Generator().manual_seed(0)))

    def forward(self, tokens):
        return self.logits.log_softmax(-1).expand(len(tokens), -1, -1).gather(-1, tokens[..., None])[..., 0]


def data():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 600, (8, 7), generator=g)
    adv = torch.randn(8, generator=g)
    valid = torch.arange(7)[None, :] < torch.tensor([7, 3, 5, 7, 1, 6, 2, 4])[:, None]  # ragged: 35 tokens
    old = Policy()(tokens).detach() + torch.randn(8, 7, generator=g) * 0.1
    return tokens, old, adv, valid


def step_grad(policy, tokens, old, adv, valid, world, scale):
    """One STAPO step on this rank's rows; scale: 'global/W', 'global' or 'loss*W' (num_tokens = global
    count, loss multiplied by W), or 'per-rank tau_h' (global/W, but each rank's own threshold). Returns
    the gradient the wrapper leaves on the parameter."""
    logits = (policy.module if world > 1 else policy).logits
    logp = policy(tokens)
    with torch.no_grad():
        p, h = logp.detach(), (-(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)).expand_as(logp)
    mine = h[s2t_candidates(p, adv, valid, tau_p=0.01)]
    pooled = [mine]
    if world > 1 and scale != "per-rank tau_h":
        pooled = [None] * world
        dist.all_gather_object(pooled, mine)  # every rank's candidates' entropies
    keep = valid & ~s2t_mask(p, h, adv, valid, 0.01, tau_h=s2t_threshold(torch.cat(pooled)))
    kept = keep.sum().float()
    if world > 1:
        dist.all_reduce(kept)
    num_tokens = kept if scale in ("global", "loss*W") else kept / world
    loss, _ = stapo_loss(logp, old, adv, keep, num_tokens=num_tokens)
    (loss * world if scale == "loss*W" else loss).backward()
    return logits.grad


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, old, adv, valid = data()
    rows = slice(0, 3) if rank == 0 else slice(3, 8)  # uneven shares: 3 and 5 rows
    grads = {scale: step_grad(torch.nn.parallel.DistributedDataParallel(Policy()), tokens[rows], old[rows],
                              adv[rows], valid[rows], world, scale) for scale in SCALES}
    if rank == 0:
        torch.save(grads, sys.argv[1])
    dist.barrier()  # every rank's work is done
    # No teardown: in CI, this script's and test_distributed.py's TWO_RANK_WEIGHTS's rank 1 each once aborted at
    # their end ("terminate called without an active exception"), the group's teardown the likely place.
    os._exit(0)
