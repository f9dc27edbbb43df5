"""policy.py: the policy the trainer trains, and its passes over a batch. A causal LM sharded by FSDP2 whose
forward gives each response token's log p and entropy (head.ChunkedHead: never the full logits), built from a
checkpoint read once; and the micro-batched passes of stapo.py's step over it.
"""
import math
import warnings
from dataclasses import dataclass
from functools import cache, partial
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch._dynamo.exc import RestartAnalysis, SkipFrame
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from transformers import AutoConfig, AutoModelForCausalLM

from head import ChunkedHead
from parallel import all_reduce_numbers, full_tensor


# ---- the model -----------------------------------------------------------------------------------

class Policy(torch.nn.Module):
    """A causal LM whose forward gives log p, H and, if asked, sum pi^2 ([M] each) of the response tokens,
    never the full logits."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        # transformers builds each forward's causal mask and, looking for packed sequences, reads a tensor
        # back (a wait on the GPU). Right-padded ids need no mask where the attention kernel masks causally
        # itself: there, the masks are given as None, which is what transformers would have built.
        config = lm.config
        causal = config._attn_implementation in ("sdpa", "flash_attention_2", "flash_attention_3")
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        self.masks = {kind: None for kind in kinds} if causal and kinds == {"full_attention"} else None

    def forward(self, ids, at, temperature, collision=False):
        """ids [B, T] are right-padded, so causal attention alone never lets a real token see a pad: no
        mask is needed, and attention runs the fused causal kernel (no [T, T] mask or scores). at [M]: the
        flat positions in ids whose hidden state predicts a response token (the token at + 1). The head
        picks its chunk for the device (head.chunk_rows)."""
        h = self.lm.get_decoder()(input_ids=ids, attention_mask=self.masks, use_cache=False).last_hidden_state
        weight = self.lm.get_output_embeddings().weight
        hidden, tokens = h.flatten(0, 1).index_select(0, at), ids.flatten().index_select(0, at + 1)
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
    are filled by broadcast from it (8 ranks do not hold 8 full copies). checkpointing: set_checkpointing;
    compiled: compile_layers."""
    config = AutoConfig.from_pretrained(path)
    export_dtype = getattr(config, "dtype", None) or torch.float32  # save_hf exports this dtype
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    refuse_unusual_head(lm, path)
    lm.export_dtype = export_dtype
    set_checkpointing(lm, checkpointing)
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
    compile_layers(lm, compiled)  # after fully_shard: FSDP2's hooks stay outside the compiled graphs
    return policy.train()


def build_optimizer(policy, lr, weight_decay):
    """AdamW over the policy's sharded parameters: fused (one kernel per step) on a GPU, foreach on a CPU."""
    one_kernel = dict(fused=True) if next(policy.parameters()).device.type == "cuda" else dict(foreach=True)
    return torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=weight_decay, **one_kernel)


# ---- the decoder layers: checkpointed, compiled -------------------------------------------------

# Selective checkpointing keeps these ops' outputs from the forward, and recomputes the rest of a layer (its
# norms, RoPE, SwiGLU's activation, the residual adds): the matmuls and attention, the costly part, run once.
SAVED_BY_SELECTIVE = {getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")}


def keep_matmuls(ctx, op, *args, **kwargs):
    """The selective policy: keep the outputs of SAVED_BY_SELECTIVE's ops, recompute the others."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


CHECKPOINTING = {  # --checkpointing: torch.utils.checkpoint's keywords for each layer, or None (off)
    "full": {},  # every activation of the layer recomputed in the backward
    "selective": {"context_fn": partial(create_selective_checkpoint_contexts, keep_matmuls)},
    "off": None,  # every activation kept from the forward
}


def set_checkpointing(lm, mode):
    """Activation checkpointing of each decoder layer (--checkpointing): full, selective or off (CHECKPOINTING).
    Each layer's forward runs through run_layer, inside what compile_layers compiles, so a compiled layer's
    backward recomputes what the checkpoint dropped in its own graph."""
    for layer in lm.get_decoder().layers:
        layer.forward = partial(run_layer, type(layer).forward.__get__(layer), CHECKPOINTING[mode])


EAGER_LAYER_CALLS = [0]  # decoder-layer calls that ran outside a compiled graph (run_layer counts them)


def run_layer(forward, checkpointing, *args, **kwargs):
    """A decoder layer's forward as the policy runs it: under activation checkpointing (with the keywords
    `checkpointing`; None: off) when it builds a graph for a backward, and counted in EAGER_LAYER_CALLS when
    it runs outside a compiled graph (a compiled layer that fell back, or eager layers)."""
    if not torch.compiler.is_compiling():
        EAGER_LAYER_CALLS[0] += 1
    if checkpointing is None or not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **checkpointing, **kwargs)


def layers_compiled(flag, device):
    """--compile-layers auto|on|off: whether compile_layers runs (auto: on CUDA only; CPU runs stay eager)."""
    return flag == "on" or (flag == "auto" and device.type == "cuda")


def layers_are_compiled(lm):
    """Whether compile_layers compiled the decoder layers."""
    return all(layer._compiled_call_impl is not None for layer in lm.get_decoder().layers)


# A run's compiled layers make a few cache entries on run_layer's one code object, all in its first step:
# grad on and off, a micro-batch of one sample and of more (dynamic shapes still specialise a size of 1), a
# length first compiled equal to another size of the layer (dynamo's duck sizing). Past this limit a variant
# runs eager for the rest of the run (counted in eager_layer_calls); torch's default is 8.
RECOMPILE_LIMIT = 64


def compile_layers(lm, on, backend="inductor"):
    """torch.compile of each decoder layer, in place (on), or eager again (off). The compiled layer fuses
    its norms, RoPE, SwiGLU and residual adds, and its checkpoint's recompute (set_checkpointing); shapes are
    dynamic (micro-batches differ in length), FSDP2's hooks run eager (dynamo skips them), and the parameters'
    names stay as they were (checkpoints, syncs). A graph that fails to compile runs eager, with one warning."""
    backend = eager_on_failure(backend) if on else None  # one for every layer: they share one cache
    for layer in lm.get_decoder().layers:
        if on:
            layer.compile(dynamic=True, backend=backend, recompile_limit=RECOMPILE_LIMIT)
        else:
            layer._compiled_call_impl = None  # what nn.Module.compile sets; None: the eager forward


@cache  # one per backend: a new one would make dynamo compile every layer's variants again
def eager_on_failure(backend):
    """`backend` (a name or a compiler), whose failure on a graph warns once and runs that graph eager."""
    compile_graph = torch._dynamo.lookup_backend(backend)

    def compile_or_eager(graph, example_inputs):
        try:
            return compile_graph(graph, example_inputs)
        except (torch.OutOfMemoryError, RestartAnalysis, SkipFrame):  # dynamo's own signals pass through
            raise
        except Exception as e:  # noqa: BLE001  (a compiler that fails on this graph: the layers run eager)
            if not COMPILE_FAILED:
                warnings.warn(f"policy.py: torch.compile of a decoder layer failed; that layer graph runs eager, "
                              f"slower ({type(e).__name__}: {' '.join(str(e).split())[:200]}). "
                              "--compile-layers off runs every layer eager from the start")
            COMPILE_FAILED.append(e)
            return graph.forward
    return compile_or_eager


COMPILE_FAILED = []  # the errors of decoder-layer graphs that failed to compile


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


class MicroBatch(NamedTuple):
    part: slice     # its samples: a slice of the mini-batch's idx
    idle: bool      # a rank with fewer micro-batches than another runs its first sample, for nothing


def micro_batches(rows, idx, budget):
    """Split idx, sample indices sorted by length (shortest first, as split_minibatches gives them), into
    micro-batches of at most `budget` padded tokens (cut_by_length: similar lengths share one, so little of it
    is padding). Every rank gets the same count (FSDP's collectives need it): a rank with fewer runs idle ones,
    its first sample computed and weighed 0."""
    n = [len(rows[i][0]) + len(rows[i][1]) for i in idx]
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
    logp, entropy, sum_sq = policy(ids, at, temperature, collision)
    padded = lambda x: x.new_zeros(len(idx) * R).index_copy(0, to, x).view(len(idx), R)  # noqa: E731
    return TokenStats(padded(logp), padded(entropy), padded(sum_sq) if collision else None)


def to_device(x, device):
    """A host tensor on `device` without waiting: through pinned memory on CUDA."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


@torch.no_grad()
def token_stats(policy, rows, idx, valid, micro_tokens, temperature, collision=False):
    """The TokenStats of mini-batch idx without a graph (its log p, H and, if asked, sum pi^2), computed in
    the micro-batches stapo.update runs it in: the same shapes, so the same numbers for the same weights
    (with eager layers; docs/training.md: compiled layers)."""
    out = TokenStats.zeros((len(idx), valid.shape[1]), valid.device, collision)
    for part, idle in micro_batches(rows, idx, micro_tokens):
        stats = response_logprobs(policy, rows, idx[part], valid, temperature, collision)
        if not idle:
            out[part] = stats
    return out
