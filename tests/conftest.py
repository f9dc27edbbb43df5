import getpass
import os
import sys
import tempfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import toy_model  # noqa: E402  the one warm start of the tests

# ATEN_CPU_CAPABILITY=avx2|default runs another CPU's kernels on this one. Inductor's and vLLM's compile caches do
# not tell the settings apart: a kernel cached under one setting segfaulted (avx2) or did not build (default)
# under another. So each setting compiles into caches of its own; the native one keeps the usual caches.
CAPABILITY = os.environ.get("ATEN_CPU_CAPABILITY")
if CAPABILITY:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{CAPABILITY}"))
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.expanduser(f"~/.cache/vllm_{CAPABILITY}"))


def warm_start(tmp_path_factory, name, **kw):
    """toy_model(d, **kw) built once per test session, however many pytest-xdist workers share it (each
    worker has a session of its own: without the lock each built its own copy, seconds of CPU apiece, on the
    cores the other worker's tests run on); d and the tokenizer, loaded from d/model as toy_model loads it."""
    from filelock import FileLock
    from transformers import AutoTokenizer
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' common folder (pytest-xdist's basetemp/popen-gwN)
    d = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (d / "train.jsonl").exists():  # toy_model writes it last
            d.mkdir(exist_ok=True)
            toy_model(d, **kw)
    return d, AutoTokenizer.from_pretrained(d / "model")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The toy's tiny Qwen3 + tokenizer, warm-started so that some answers are right (rewards vary),
    and the toy's training problems."""
    return warm_start(tmp_path_factory, "tiny")


@pytest.fixture(scope="session")
def tiny_vllm(tmp_path_factory):
    """The toy's model at hidden 128 (head_dim 32, a size vLLM's CPU attention accepts)."""
    return warm_start(tmp_path_factory, "tiny_vllm", hidden=128)


@pytest.fixture(scope="session")
def tiny_vllm_tied(tmp_path_factory):
    """Its input embedding is its LM head, as in Qwen3-0.6B, 1.7B and 4B."""
    return warm_start(tmp_path_factory, "tiny_vllm_tied", hidden=128, tied=True)


@pytest.fixture
def one_thread():
    """In-process runs on one thread, as the subprocess runs (OMP_NUM_THREADS=1): the same float order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(items):
    """The slow tests first (in their files' order): on test.sh's two workers the longest runs start at once
    instead of last, where one of them would leave the other worker idle at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_sessionfinish(session, exitstatus):
    """The in-process trainer tests leave a process group; one alive at exit can abort the process."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
