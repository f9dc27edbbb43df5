"""A fake `vllm` for what vLLM's CPU build cannot show: the GPU path's sleep/wake order.

Every call is recorded in CALLS, in order. It enforces the real limits that the GPU path would hit:
sleep needs enable_sleep_mode, a sleeping engine cannot generate, wake_up needs a sleeping engine,
allowed_token_ids is capped at 1,024 (MAX_NUM_ALLOWED_TOKEN_IDS in vLLM 0.32's default model runner),
and a process builds one engine, ever. vLLM 0.32's GPU build keeps process-wide state for one engine:
the rotary modules in _ROPE_DICT (model_executor/layers/rotary_embedding/__init__.py:29,84-85,351),
cleared only at an engine's shutdown, whose buffers sit in the sleeping engine's unmapped CuMem pool;
the CuMem allocator singleton ("CuMem allocator can only be used for one instance per process",
v1/worker/gpu_worker.py:399-401), whose pools any engine's shutdown releases (gpu_worker.py:1628-1634).
With FAKE_VLLM_LOG set, each build appends {"pid", "model", "enable_sleep_mode"} to that file.
reset_prefix_cache returns True, as the real one does once no request holds a block (block_pool.py:827-843).
llm_engine.engine_core.shutdown() is vLLM's shutdown (v1/engine/core_client.py:401-403); it refuses a sleeping
engine that was never asked to wake, whose unmapped CuMem memory the real one would free with CUDA errors
(device_allocator/cumem.py:204-231). With WAKE_FAILS set (an exception), wake_up raises it, as the real one
raises the out-of-memory of the allocation it could not map (cumem.py:345-351, create_and_map, one allocation
at a time), and the engine stays asleep; its shutdown then goes ahead, as the real one does (printing CUDA
errors for the memory still unmapped): the order a close must keep, wake_up first, then the shutdown whatever
the wake did.
Generation returns fixed tokens: the real engine's sampling is tested against vLLM's CPU build.
"""
import json
import os
from types import SimpleNamespace

CALLS = []
WAKE_FAILS = None  # an exception for every wake_up to raise (a test sets it)
MAX_NUM_ALLOWED_TOKEN_IDS = 1024
BUILT = []  # the models this process built an engine for: one at most


class SamplingParams:
    def __init__(self, **kw):
        if len(kw.get("allowed_token_ids") or []) > MAX_NUM_ALLOWED_TOKEN_IDS:
            raise ValueError(f"at most {MAX_NUM_ALLOWED_TOKEN_IDS} allowed_token_ids")
        self.kw = kw


class LLM:
    def __init__(self, model, **kwargs):
        if BUILT:
            raise RuntimeError(f"a second vLLM engine in process {os.getpid()} (its first: {BUILT[0]}): vLLM "
                               "keeps process-wide state for one engine")
        BUILT.append(model)
        CALLS.append(("LLM", {"model": model, **kwargs}))
        self.kwargs, self.asleep, self.wake_tried = kwargs, set(), False
        if os.environ.get("FAKE_VLLM_LOG"):
            with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "model": model,
                                    "enable_sleep_mode": kwargs.get("enable_sleep_mode")}) + "\n")

    def sleep(self, level=1):
        if not self.kwargs.get("enable_sleep_mode"):
            raise ValueError("Sleep mode is not enabled")
        CALLS.append(("sleep", level))
        self.asleep, self.wake_tried = {"weights", "kv_cache"}, False

    def wake_up(self, tags=None):
        tags = set(tags or ("weights", "kv_cache"))
        if not tags <= self.asleep:
            raise RuntimeError(f"wake_up({sorted(tags)}) on an engine that is not asleep")
        self.wake_tried = True
        if WAKE_FAILS is not None:
            CALLS.append(("wake_up failed", tuple(sorted(tags))))
            raise WAKE_FAILS
        CALLS.append(("wake_up", tuple(sorted(tags))))
        self.asleep -= tags

    @property
    def llm_engine(self):
        def shutdown():
            if self.asleep and not self.wake_tried:
                raise RuntimeError("shutdown of a sleeping engine: its unmapped memory would be freed")
            CALLS.append(("shutdown", "asleep") if self.asleep else ("shutdown",))
        return SimpleNamespace(engine_core=SimpleNamespace(shutdown=shutdown))

    def collective_rpc(self, method, kwargs=None):
        CALLS.append(("collective_rpc", method, [name for name, _ in kwargs["weights_iterator"]]))
        return [None]

    def reset_prefix_cache(self):
        CALLS.append(("reset_prefix_cache",))
        return True  # generate() returns only once its requests are done: no block is held

    def generate(self, prompts, sampling_params, use_tqdm=True):
        if self.asleep:
            raise RuntimeError("generate on a sleeping engine")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params]
        CALLS.append(("generate", [p["prompt_token_ids"] for p in prompts], [sp.kw for sp in params]))
        done = SimpleNamespace(token_ids=[1, 2], finish_reason="stop",
                               logprobs=[{1: SimpleNamespace(logprob=-0.5)}, {2: SimpleNamespace(logprob=-0.25)}])
        return [SimpleNamespace(outputs=[done] * sp.kw.get("n", 1)) for sp in params]
