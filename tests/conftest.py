import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
import toy  # noqa: E402


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The toy's tiny Qwen3 + tokenizer, warm-started so that some answers are right (rewards vary),
    and the toy's training problems."""
    d = tmp_path_factory.mktemp("tiny")
    tok = toy.build_tokenizer(str(d / "model"))
    train = toy.problems()[0]
    toy.warm_start(toy.build_model(str(d / "model"), tok), tok, train, steps=120).save_pretrained(d / "model")
    with open(d / "train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in train)
    return d, tok


def vllm_sized(d, tied):
    """The toy's model at hidden 128 (head_dim 32, a size vLLM's CPU attention accepts), warm-started."""
    tok = toy.build_tokenizer(str(d / "model"))
    train = toy.problems()[0]
    model = toy.build_model(str(d / "model"), tok, hidden=128, tied=tied)
    toy.warm_start(model, tok, train, steps=120).save_pretrained(d / "model")
    with open(d / "train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in train)
    return d, tok


@pytest.fixture(scope="session")
def tiny_vllm(tmp_path_factory):
    return vllm_sized(tmp_path_factory.mktemp("tiny_vllm"), tied=False)


@pytest.fixture(scope="session")
def tiny_vllm_tied(tmp_path_factory):
    """Its input embedding is its LM head, as in Qwen3-0.6B, 1.7B and 4B."""
    return vllm_sized(tmp_path_factory.mktemp("tiny_vllm_tied"), tied=True)


def pytest_collection_modifyitems(items):
    """The slow tests first (in their files' order): on test.sh's two workers the longest runs start at once
    instead of last, where one of them would leave the other worker idle at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_sessionfinish(session, exitstatus):
    """The in-process trainer tests leave a process group; one alive at exit can abort the process."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
