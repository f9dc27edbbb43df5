"""policy.py: the policy the trainer trains, and its passes over a batch. A causal LM sharded by FSDP2 whose
forward gives each response token's log p and entropy (head.ChunkedHead: never the full logits), built from a
checkpoint read once; and the micro-batched passes of stapo.py's step over it.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from head import ChunkedHead
from parallel import all_reduce_numbers


# ---- the model -----------------------------------------------------------------------------------

class Policy(torch.nn.Module):
    """A causal LM whose forward gives log p, H and, if asked, sum pi^2 ([M] each) of the response tokens,
    never the full logits."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, response, temperature, collision=False):
        """ids are right-padded, so causal attention alone never lets a real token see a pad: no
        mask is needed, and attention runs the fused causal kernel (no [T, T] mask or scores). The head
        picks its chunk for the device (head.chunk_rows)."""
        h = self.lm.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        at = response[:, 1:]  # the hidden state at t predicts token t + 1
        weight = self.lm.get_output_embeddings().weight
        return ChunkedHead.apply(h[:, :-1][at], weight, ids[:, 1:][at], float(temperature), None, collision)


def refuse_unusual_head(lm, path):
    """Policy computes logits as hidden @ lm_head.weight; a model whose logits differ is refused."""
    scalings = ("final_logit_softcapping", "logit_scale", "logits_scaling")
    values = {k: getattr(lm.config, k, None) for k in scalings}
    odd = [f"{k}={v}" for k, v in values.items() if v not in (None, 1, 1.0)]
    if getattr(lm.get_output_embeddings(), "bias", None) is not None:
        odd.append("an lm_head bias")
    if odd:
        raise ValueError(f"--model {path}: its logits are not hidden @ lm_head.weight "
                         f"({', '.join(odd)}); policy.Policy would compute wrong log-probs for it, "
                         "so it is refused")


def build_policy(path, mesh, device, dtype=torch.float32):
    """fp32 master weights sharded by FSDP2 per decoder layer, then the root; `dtype` is the compute
    dtype (--dtype bf16: bf16 forward and backward, gradients reduced in fp32). Every rank builds
    the model on the meta device; only rank 0 reads the checkpoint into host memory, and the shards
    are filled by broadcast from it (8 ranks do not hold 8 full copies)."""
    config = AutoConfig.from_pretrained(path)
    export_dtype = getattr(config, "dtype", None) or torch.float32  # save_hf exports this dtype
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    refuse_unusual_head(lm, path)
    lm.export_dtype = export_dtype
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    policy = Policy(lm)
    for layer in lm.get_decoder().layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(policy, mesh=mesh, mp_policy=mp)
    policy.to_empty(device=device)
    full = None
    if dist.get_rank() == 0:
        full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(lm, full.state_dict() if full else {}, options=options)
    for name, buffer in lm.named_buffers():  # non-persistent (rotary inv_freq): in no state dict
        if full is not None:
            buffer.copy_(full.get_buffer(name))
        dist.broadcast(buffer, src=0)
    return policy.train()


def head_grad_norm(policy):
    """||grad|| of the LM head's weight (a tied head's: the embedding's, both uses summed), before any clip.
    One number per update: the warning sign when one rollout batch feeds several updates (Dynamic Gradient
    Gating, a paper that cites STAPO)."""
    norm = policy.lm.get_output_embeddings().weight.grad.norm()
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


# ---- the policy's passes over a batch ------------------------------------------------------------

def micro_batches(rows, idx, budget):
    """Split sample indices into micro-batches of at most `budget` padded tokens, shortest samples
    first (similar lengths share a micro-batch, so little of it is padding), the same count on every
    rank (FSDP's collectives need it): a rank with fewer runs empty ones (None)."""
    out, cur, longest = [], [], 0
    for i in sorted(idx, key=lambda i: len(rows[i][0]) + len(rows[i][1])):
        n = len(rows[i][0]) + len(rows[i][1])
        if cur and max(longest, n) * (len(cur) + 1) > budget:
            out.append(cur)
            cur, longest = [], 0
        cur, longest = cur + [i], max(longest, n)
    if cur:
        out.append(cur)
    count = int(all_reduce_numbers(len(out), op=dist.ReduceOp.MAX)[0])
    return out + [None] * (count - len(out))


@dataclass
class TokenStats:
    """The policy at each response token of some samples: [n, R] tensors, zero at padding."""
    logp: torch.Tensor              # log p of the sampled token (with the graph from response_logprobs)
    entropy: torch.Tensor           # H at its position, in nats (no graph)
    collision: torch.Tensor = None  # sum pi^2 there (no graph): only when asked, for stapo.py --analysis

    @staticmethod
    def zeros(shape, device, collision=False):
        new = lambda: torch.zeros(shape, device=device)  # noqa: E731
        return TokenStats(new(), new(), new() if collision else None)

    def __getitem__(self, rows):
        collision = None if self.collision is None else self.collision[rows]
        return TokenStats(self.logp[rows], self.entropy[rows], collision)

    def __setitem__(self, rows, part):
        self.logp[rows], self.entropy[rows] = part.logp, part.entropy
        if self.collision is not None:
            self.collision[rows] = part.collision


def response_logprobs(policy, rows, idx, valid, temperature, collision=False):
    """The policy's one forward path: the TokenStats [len(idx), R] of the response tokens of samples idx
    (zero outside `valid`), log p with the graph."""
    device = valid.device
    seqs = [rows[i][0] + rows[i][1] for i in idx]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    response = torch.zeros_like(ids, dtype=torch.bool)
    for k, (i, s) in enumerate(zip(idx, seqs)):
        ids[k, :len(s)] = torch.tensor(s)
        response[k, len(rows[i][0]):len(s)] = True
    logp, entropy, sum_sq = policy(ids.to(device), response.to(device), temperature, collision)
    v = valid[idx]
    padded = lambda x: torch.zeros(v.shape, device=device).masked_scatter(v, x)  # noqa: E731
    return TokenStats(padded(logp), padded(entropy), padded(sum_sq) if collision else None)


@torch.no_grad()
def token_stats(policy, rows, idx, valid, micro_tokens, temperature, collision=False):
    """The TokenStats of mini-batch idx without a graph (its log p, H and, if asked, sum pi^2), computed in
    the micro-batches stapo.update runs it in: the same shapes, so the same numbers for the same weights."""
    out = TokenStats.zeros((len(idx), valid.shape[1]), valid.device, collision)
    at = {i: k for k, i in enumerate(idx)}
    for micro in micro_batches(rows, idx, micro_tokens):
        part = response_logprobs(policy, rows, micro or idx[:1], valid, temperature, collision)
        if micro:  # None: this rank has fewer micro-batches than another, and runs one sample for nothing
            out[[at[i] for i in micro]] = part
    return out
