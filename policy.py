"""policy.py: the policy the trainer trains, and its passes over a batch. A causal LM sharded by FSDP2 whose
forward gives each response token's log p and the head's statistics (head.ChunkedHead: never the full
logits), built from a checkpoint read once; and the micro-batched passes of stapo.py's step over it.
"""
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from head import ChunkedHead
from parallel import all_reduce_numbers


# ---- the model -----------------------------------------------------------------------------------

class Policy(torch.nn.Module):
    """A causal LM whose forward gives log p and the head's [M, 2] statistics (H, sum pi^2) of the
    response tokens, never the full logits."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, response, temperature):
        """ids are right-padded, so causal attention alone never lets a real token see a pad: no
        mask is needed, and attention runs the fused causal kernel (no [T, T] mask or scores)."""
        h = self.lm.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        at = response[:, 1:]  # the hidden state at t predicts token t + 1
        weight = self.lm.get_output_embeddings().weight
        return ChunkedHead.apply(h[:, :-1][at], weight, ids[:, 1:][at], float(temperature), 128)


def refuse_unusual_head(lm, path):
    """Policy computes logits as hidden @ lm_head.weight; a model whose logits differ is refused."""
    scalings = ("final_logit_softcapping", "logit_scale", "logits_scaling")
    values = {k: getattr(lm.config, k, None) for k in scalings}
    odd = [f"{k}={v}" for k, v in values.items() if v not in (None, 1, 1.0)]
    if getattr(lm.get_output_embeddings(), "bias", None) is not None:
        odd.append("an lm_head bias")
    if odd:
        raise ValueError(f"--model {path}: its logits are not hidden @ lm_head.weight "
                         f"({', '.join(odd)}); stapo.Policy would compute wrong log-probs for it, "
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


def response_logprobs(policy, rows, idx, valid, temperature):
    """The policy's one forward path: log p [len(idx), R] of the response tokens of samples idx
    (zero outside `valid`), with the graph, and the head's statistics [len(idx), R, 2]."""
    device = valid.device
    seqs = [rows[i][0] + rows[i][1] for i in idx]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    response = torch.zeros_like(ids, dtype=torch.bool)
    for k, (i, s) in enumerate(zip(idx, seqs)):
        ids[k, :len(s)] = torch.tensor(s)
        response[k, len(rows[i][0]):len(s)] = True
    logp, stats = policy(ids.to(device), response.to(device), temperature)
    v = valid[idx]
    padded = torch.zeros(*v.shape, 2, device=device)
    padded[v] = stats
    return torch.zeros(v.shape, device=device).masked_scatter(v, logp), padded


@torch.no_grad()
def measure(policy, rows, idx, valid, micro_tokens, temperature):
    """response_logprobs of mini-batch idx without a graph, in the micro-batches update() runs it
    in: the same shapes, so the same numbers for the same weights."""
    logp = torch.zeros(len(idx), valid.shape[1], device=valid.device)
    stats = torch.zeros(len(idx), valid.shape[1], 2, device=valid.device)
    at = {i: k for k, i in enumerate(idx)}
    for mb in micro_batches(rows, idx, micro_tokens):
        out = response_logprobs(policy, rows, mb or idx[:1], valid, temperature)
        if mb:
            logp[[at[i] for i in mb]], stats[[at[i] for i in mb]] = out
    return logp, stats
