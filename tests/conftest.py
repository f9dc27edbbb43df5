import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import toy_model  # noqa: E402  the one warm start of the tests


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The toy's tiny Qwen3 + tokenizer, warm-started so that some answers are right (rewards vary),
    and the toy's training problems."""
    d = tmp_path_factory.mktemp("tiny")
    return d, toy_model(d)


@pytest.fixture(scope="session")
def tiny_vllm(tmp_path_factory):
    """The toy's model at hidden 128 (head_dim 32, a size vLLM's CPU attention accepts)."""
    d = tmp_path_factory.mktemp("tiny_vllm")
    return d, toy_model(d, hidden=128)


@pytest.fixture(scope="session")
def tiny_vllm_tied(tmp_path_factory):
    """Its input embedding is its LM head, as in Qwen3-0.6B, 1.7B and 4B."""
    d = tmp_path_factory.mktemp("tiny_vllm_tied")
    return d, toy_model(d, hidden=128, tied=True)


def pytest_collection_modifyitems(items):
    """The slow tests first (in their files' order): on test.sh's two workers the longest runs start at once
    instead of last, where one of them would leave the other worker idle at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_sessionfinish(session, exitstatus):
    """The in-process trainer tests leave a process group; one alive at exit can abort the process."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
