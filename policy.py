"""policy.py: the policy the trainer trains, and its passes over a batch. A causal LM sharded by FSDP2 whose
forward gives each response token's log p and entropy (head.ChunkedHead: never the full logits), built from a
checkpoint read once, its decoder layers run as layers.py says; and the micro-batched passes of stapo.py's step
over it.
"""
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from head import ChunkedHead
from layers import compile_layers, run_through
from parallel import all_reduce_numbers, full_tensor


# ---- the model -----------------------------------------------------------------------------------

class Policy(torch.nn.Module):
    """A causal LM whose forward gives log p, H and, in its no-grad passes when asked (collision), sum pi^2
    ([M] each) of the response tokens, never the full logits. layers: how its decoder layers run
    (layers.Layers: their checkpointing, whether compiled, the calls that ran eager)."""

    def __init__(self, lm, layers):
        super().__init__()
        self.lm, self.layers = lm, layers
        self.collision = False  # True: the no-grad passes give sum pi^2 too (stapo.py --analysis: analysis.py)
        # transformers builds each forward's causal mask and, looking for packed sequences, reads a tensor
        # back (a wait on the GPU). Right-padded ids need no mask where the attention kernel masks causally
        # itself: there, the masks are given as None, which is what transformers would have built.
        config = lm.config
        causal = config._attn_implementation in ("sdpa", "flash_attention_2", "flash_attention_3")
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        self.masks = {kind: None for kind in kinds} if causal and kinds == {"full_attention"} else None

    def forward(self, ids, at, temperature):
        """ids [B, T] are right-padded, so causal attention alone never lets a real token see a pad: no
        mask is needed, and attention runs the fused causal kernel (no [T, T] mask or scores). at [M]: the
        flat positions in ids whose hidden state predicts a response token (the token at + 1). The decoder
        calls each of its layers through layers.run_layer (self.layers: checkpointed, compiled or eager);
        the head picks its chunk for the device (head.chunk_rows)."""
        h = self.lm.get_decoder()(input_ids=ids, attention_mask=self.masks, use_cache=False).last_hidden_state
        weight = self.lm.get_output_embeddings().weight
        hidden, tokens = h.flatten(0, 1).index_select(0, at), ids.flatten().index_select(0, at + 1)
        collision = self.collision and not torch.is_grad_enabled()
        return ChunkedHead.apply(hidden, weight, tokens, float(temperature), None, collision)


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


def build_policy(path, mesh, device, dtype=torch.float32, compiled=False, checkpointing="full"):
    """fp32 master weights sharded by FSDP2 per decoder layer, then the root; `dtype` is the compute
    dtype (--dtype bf16: bf16 forward and backward, gradients reduced in fp32). Every rank builds
    the model on the meta device; only rank 0 reads the checkpoint into host memory, and the shards
    are filled by broadcast from it (8 ranks do not hold 8 full copies). Its decoder layers run through
    layers.run_layer, checkpointed as `checkpointing` says (full, selective, off), and compiled when
    `compiled` (layers.compile_layers; else eager)."""
    config = AutoConfig.from_pretrained(path)
    export_dtype = getattr(config, "dtype", None) or torch.float32  # save_hf exports this dtype
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    refuse_unusual_head(lm, path)
    lm.export_dtype = export_dtype
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    policy = Policy(lm, run_through(lm, checkpointing))
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
    if compiled:  # after fully_shard: FSDP2's hooks stay outside the compiled graphs
        compile_layers(lm, policy.layers)
    return policy.train()


def build_optimizer(policy, lr, weight_decay):
    """AdamW over the policy's sharded parameters: fused (one kernel per step) on a GPU, foreach on a CPU."""
    one_kernel = dict(fused=True) if next(policy.parameters()).device.type == "cuda" else dict(foreach=True)
    return torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=weight_decay, **one_kernel)


def head_grad_norm(policy):
    """||grad|| of the LM head's weight (a tied head's: the embedding's, both uses summed), before any clip.
    One number per update: the warning sign when one rollout batch feeds several updates (Dynamic Gradient
    Gating, a paper that cites STAPO)."""
    return float(full_tensor(policy.lm.get_output_embeddings().weight.grad.norm()))


# ---- the policy's passes over a batch ------------------------------------------------------------

# A micro-batch's fixed cost in tokens, as a share of --micro-tokens: its launches, FSDP's all-gathers and
# reduce-scatters. cut_by_length weighs it against the padding a cut saves (docs/performance.md: padding).
MICRO_BATCH_COST = 1 / 16


def cut_by_length(lengths, budget, cost=MICRO_BATCH_COST):
    """Cut `lengths`, sorted shortest first, into consecutive micro-batches of at most `budget` padded tokens
    (each padded to its last, its longest; a length over the budget alone): a list of slices. The cut computes
    the fewest tokens, padding included, plus `cost` x budget for each micro-batch: an exact dynamic programme
    over the cut points. On a long tail it makes a few more micro-batches and half the padding of the fewest
    that fit."""
    best, cut = [0.0] + [math.inf] * len(lengths), [0] * (len(lengths) + 1)
    for end in range(1, len(lengths) + 1):  # best[end]: the first `end` lengths, the last cut [start, end)
        for start in range(end - 1, -1, -1):
            if end - start > 1 and (end - start) * lengths[end - 1] > budget:
                break
            total = best[start] + (end - start) * lengths[end - 1] + cost * budget
            if total < best[end]:
                best[end], cut[end] = total, start
    out, end = [], len(lengths)
    while end:
        out.append(slice(cut[end], end))
        end = cut[end]
    return out[::-1]


def length(row):
    """A sample's tokens, its prompt's and its response's (row: one (prompt ids, response ids) of a batch):
    what a micro-batch holding it is padded to."""
    return len(row[0]) + len(row[1])


def shortest_first(rows, idx):
    """Sample indices idx sorted by their samples' lengths, shortest first: the order micro_batches cuts."""
    return sorted(idx, key=lambda i: length(rows[i]))


class MicroBatch(NamedTuple):
    part: slice     # its samples: a slice of the mini-batch's idx
    idle: bool      # a rank with fewer micro-batches than another runs its first sample, for nothing


def micro_batches(rows, idx, budget):
    """Split idx, sample indices sorted by length (shortest_first, as split_minibatches gives them), into
    micro-batches of at most `budget` padded tokens (cut_by_length: similar lengths share one, so little of it
    is padding). Every rank gets the same count (FSDP's collectives need it): a rank with fewer runs idle ones,
    its first sample computed and weighed 0."""
    n = [length(rows[i]) for i in idx]
    if n != sorted(n):
        raise ValueError("policy.micro_batches: idx must be sorted by length, shortest first")
    out = [MicroBatch(part, False) for part in cut_by_length(n, budget, MICRO_BATCH_COST)]
    count = int(all_reduce_numbers(len(out), op=dist.ReduceOp.MAX)[0])
    return out + [MicroBatch(slice(0, 1), True)] * (count - len(out))


@dataclass
class TokenStats:
    """The policy at each response token of some samples: [n, R] tensors, zero at padding."""
    logp: torch.Tensor              # log p of the sampled token (with the graph from response_logprobs)
    entropy: torch.Tensor           # H at its position, in nats (no graph)
    collision: torch.Tensor = None  # sum pi^2 there (no graph): where the policy is asked (Policy.collision)

    @staticmethod
    def zeros(shape, device):
        return TokenStats(torch.zeros(shape, device=device), torch.zeros(shape, device=device))

    def __getitem__(self, rows):
        collision = None if self.collision is None else self.collision[rows]
        return TokenStats(self.logp[rows], self.entropy[rows], collision)

    def __setitem__(self, rows, part):
        self.logp[rows], self.entropy[rows] = part.logp, part.entropy
        if part.collision is not None:
            if self.collision is None:
                self.collision = torch.zeros_like(self.entropy)
            self.collision[rows] = part.collision


def response_logprobs(policy, rows, idx, valid, temperature):
    """The policy's one forward path: the TokenStats [len(idx), R] of the response tokens of samples idx
    (zero after each response), log p with the graph. valid: the batch's [N, R] response mask (each row's
    first len(response) entries; its shape and device are read). Every index is built here, on the host,
    and copied once (pinned on CUDA): nothing waits on the device."""
    device, R = valid.device, valid.shape[1]
    seqs = [rows[i][0] + rows[i][1] for i in idx]
    T = max(map(len, seqs))
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    at, to = [], []  # each response token: the flat position predicting it in ids, and its own in [n, R]
    for k, (i, s) in enumerate(zip(idx, seqs)):
        ids[k, :len(s)] = torch.tensor(s)
        prompt, response = len(rows[i][0]), len(rows[i][1])
        at.append(torch.arange(k * T + prompt - 1, k * T + len(s) - 1))
        to.append(torch.arange(k * R, k * R + response))
    ids, at, to = (to_device(x, device) for x in (ids, torch.cat(at), torch.cat(to)))
    logp, entropy, sum_sq = policy(ids, at, temperature)
    padded = lambda x: x.new_zeros(len(idx) * R).index_copy(0, to, x).view(len(idx), R)  # noqa: E731
    collision = policy.collision and not torch.is_grad_enabled()  # the head gave sum pi^2
    return TokenStats(padded(logp), padded(entropy), padded(sum_sq) if collision else None)


def to_device(x, device):
    """A host tensor on `device` without waiting: through pinned memory on CUDA."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


@torch.no_grad()
def token_stats(policy, rows, idx, valid, micro_tokens, temperature):
    """The TokenStats of mini-batch idx without a graph (its log p, H and, if asked, sum pi^2), computed in
    the micro-batches stapo.update runs it in: the same shapes, so the same numbers for the same weights
    (with eager layers; docs/training.md: compiled layers)."""
    out = TokenStats.zeros((len(idx), valid.shape[1]), valid.device)
    for part, idle in micro_batches(rows, idx, micro_tokens):
        stats = response_logprobs(policy, rows, idx[part], valid, temperature)
        if not idle:
            out[part] = stats
    return out
