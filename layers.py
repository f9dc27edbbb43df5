"""layers.py: how the policy runs its decoder layers, decided in one place. build_policy calls run_through once:
from then on each layer's call goes through run_layer, which checkpoints the layer's activations
(--checkpointing) and counts the calls that run outside a compiled graph. compile_layers and eager_layers then
say whether those calls are compiled. What it all amounts to is one object, Layers, that the policy holds
(Policy.layers) and the step's metrics read (eager_layer_calls).
"""
import inspect
import warnings
from dataclasses import dataclass
from functools import cache, partial

import torch
from torch._dynamo.exc import RestartAnalysis, SkipFrame
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# Selective checkpointing keeps these ops' outputs from the forward, and recomputes the rest of a layer (its
# norms, RoPE, SwiGLU's activation, the residual adds): the matmuls and attention, the costly part, run once.
SAVED_BY_SELECTIVE = frozenset(getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"))


def keep_matmuls(ctx, op, *args, **kwargs):
    """The selective policy: keep the outputs of SAVED_BY_SELECTIVE's ops, recompute the others."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


SELECTIVE = partial(create_selective_checkpoint_contexts, keep_matmuls)


def checkpoint_keywords(mode):
    """--checkpointing full|selective|off: torch.utils.checkpoint's keywords for each layer, or None (off: every
    activation kept from the forward). full recomputes every activation of the layer in the backward."""
    if mode == "off":
        return None
    if mode == "selective":
        return {"context_fn": SELECTIVE}
    return {}


@dataclass
class Layers:
    """The decoder layers' runtime: how their activations are checkpointed (checkpointing: full, selective or
    off), whether their calls are compiled (backend: compile_layers' compiler, None when eager), and the calls
    that ran in Python, outside a compiled graph (eager_calls: every call when eager; when compiled, those of
    a variant past dynamo's recompile limit, or of frames the compiler failed on, which dynamo then runs in
    Python; a step's metrics read it as a difference over the step)."""
    checkpointing: str = "full"
    backend: object = None
    eager_calls: int = 0

    @property
    def compiled(self):
        return self.backend is not None

    @property
    def failures(self):
        """The errors of the layer graphs that failed to compile (and run eager)."""
        return self.backend.failures if self.backend else []


def run_through(lm, checkpointing="full"):
    """From now on, each decoder layer's forward is run_layer around the layer's own: the one place a layer's
    forward is replaced (build_policy calls it once, before sharding). Returns the Layers that run_layer
    reads and counts into."""
    runtime = Layers(checkpointing)
    for layer in lm.get_decoder().layers:
        layer.forward = partial(run_layer, runtime, type(layer).forward.__get__(layer))
    return runtime


def run_layer(runtime, forward, *args, **kwargs):
    """A decoder layer's forward as the policy runs it: under activation checkpointing (runtime.checkpointing)
    when it builds a graph for a backward, and counted when it runs in Python. Compiled (compile_layers), this
    is the frame dynamo compiles: the checkpoint sits inside the layer's graph, so its backward recomputes in
    its own compiled graph, and the count is traced away (a compiled call moves it not)."""
    if not torch.compiler.is_compiling():
        runtime.eager_calls += 1
    keywords = checkpoint_keywords(runtime.checkpointing)
    if keywords is None or not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **keywords, **kwargs)


def should_compile(flag, device):
    """--compile-layers auto|on|off: whether build_policy compiles the layers (auto: on CUDA; CPU runs stay
    eager)."""
    return flag == "on" or (flag == "auto" and device.type == "cuda")


# A run's compiled layers make a few variants (dynamo's cache entries on run_layer's one code object), all in
# its first step: grad on and off, a micro-batch of one sample and of more (dynamic shapes still specialise a
# size of 1), a length first compiled equal to another size of the layer (dynamo's duck sizing); the
# benchmarks' lever sequences make up to about 14. Past the limit a variant runs eager for the rest of the
# process (counted in eager_calls); torch's default limit is 8.
RECOMPILE_LIMIT = 64


def compile_layers(lm, runtime, compiler="inductor"):
    """torch.compile of each decoder layer, in place (after fully_shard: FSDP2's hooks stay outside the graphs).
    The compiled layer fuses its norms, RoPE, SwiGLU and residual adds, and its checkpoint's recompute; shapes
    are dynamic (micro-batches differ in length), and the parameters' names stay as they were (checkpoints,
    syncs). A compiler that fails leaves the layers eager, counted, with one warning. The recompile limit is
    dynamo's process-wide setting, raised to RECOMPILE_LIMIT: torch 2.11's compile takes no per-call limit."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    takes = inspect.signature(torch.compile).parameters
    per_call = {"recompile_limit": RECOMPILE_LIMIT} if "recompile_limit" in takes else {}
    runtime.backend = fallback_backend(compiler)
    for layer in lm.get_decoder().layers:
        layer.compile(dynamic=True, backend=runtime.backend, **per_call)


def eager_layers(lm, runtime):
    """Each decoder layer eager again: compile_layers undone (as the layers start, and as a CPU run keeps them)."""
    runtime.backend = None
    for layer in lm.get_decoder().layers:
        layer._compiled_call_impl = None  # what nn.Module.compile sets; None: the eager forward


@cache  # one per compiler in a process: dynamo ties each compiled variant to the backend object that made it,
def fallback_backend(compiler):  # so a new one would compile every variant again
    """`compiler` (a name or a compiler function) as a dynamo backend whose failure on a graph warns once
    (keeping the error in .failures) and hands the frame back to dynamo to run in Python: run_layer then runs
    eager, its checkpoint as asked, for the rest of the process, and counts each call."""
    compile_graph = torch._dynamo.lookup_backend(compiler)

    def backend(graph, example_inputs):
        try:
            return compile_graph(graph, example_inputs)
        except (torch.OutOfMemoryError, RestartAnalysis, SkipFrame):  # dynamo's own signals pass through
            raise
        except Exception as e:  # noqa: BLE001  (a compiler that fails on this graph: the layers run eager)
            if not backend.failures:
                warnings.warn(f"layers.py: torch.compile of a decoder layer failed; the layers run eager, slower "
                              f"({type(e).__name__}: {' '.join(str(e).split())[:200]}). "
                              "--compile-layers off runs every layer eager from the start")
            backend.failures.append(e)
            raise SkipFrame(f"layers.py: the compiler failed ({type(e).__name__}); this frame runs eager") from e

    backend.failures = []
    return backend
