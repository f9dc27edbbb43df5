"""A spy on rollout.VLLMEngine.close, for tests/test_vllm.py, in every Python process started with this folder
first on PYTHONPATH (Python imports sitecustomize at its start): torchrun's ranks and eval.py's judge processes
alike. When a process imports rollout, its VLLMEngine.close is wrapped to print, before the real close,
"engine closed; process group alive: <torch.distributed.is_initialized()>" (vLLM's shutdown destroys the
process group: a close after the last barrier sees it alive). Nothing else changes.
"""
import importlib.machinery
import sys

SAID = "engine closed; process group alive:"


def spy_on(rollout):
    import torch
    real = rollout.VLLMEngine.close

    def close(self):  # one write of the whole line: two ranks share the log, and print's pieces interleave
        sys.stdout.write(f"{SAID} {torch.distributed.is_initialized()}\n")
        sys.stdout.flush()
        real(self)
    rollout.VLLMEngine.close = close


class RolloutFinder:
    """Finds `rollout` as Python would, then wraps its VLLMEngine.close once the module has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "rollout":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            spy_on(module)
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, RolloutFinder())
