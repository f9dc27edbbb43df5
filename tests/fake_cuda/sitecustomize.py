"""A fake CUDA driver that enforces EXCLUSIVE_PROCESS mode's rule, for tests/test_eval.py, in every Python process
started with FAKE_CUDA_DIR set and this folder first on PYTHONPATH (Python imports sitecustomize at its start):
the eval rank and its judge's process alike, with the HF engine on the CPU. As the driver does, a process's first
CUDA call that needs a context makes one on its GPU, kept to the process's end; with FAKE_CUDA_MODE=
Exclusive_Process a second process's fails with the driver's "busy or unavailable" error. The calls that make
one: torch.cuda.set_device (cudaSetDevice makes the context since CUDA 12), a CUDA device mesh, and an engine on
a CUDA device. FAKE_CUDA_DIR/<GPU> lists the ids of the processes with a context on that GPU (CUDA_VISIBLE_DEVICES
maps the index); a dead process's context is gone. NCCL makes its communicators, and their context, lazily: gloo
stands in for it. nvidia-smi beside this file reports FAKE_CUDA_MODE for each GPU.
"""
import os

BUSY = "CUDA error: CUDA-capable device(s) is/are busy or unavailable"


def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def claim(index):
    """This process's context on GPU `index` (as this process sees it): made once, or refused."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    path = os.path.join(os.environ["FAKE_CUDA_DIR"], visible.split(",")[index] if visible else str(index))
    holders = [int(p) for p in open(path).read().split()] if os.path.exists(path) else []
    if os.getpid() in holders:
        return
    if os.environ.get("FAKE_CUDA_MODE", "Default").startswith("Exclusive") and any(map(alive, holders)):
        raise RuntimeError(BUSY)
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")


def install():
    import torch
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh
    import rollout
    current = [0]
    real_group, real_mesh, real_engine = dist.init_process_group, device_mesh.init_device_mesh, rollout.make_engine

    def set_device(index):
        claim(int(index))
        current[0] = int(index)

    def init_process_group(backend=None, *args, **kwargs):
        return real_group("gloo" if backend and "nccl" in backend else backend, *args, **kwargs)

    def init_device_mesh(device_type, *args, **kwargs):
        if device_type == "cuda":
            claim(current[0])
        return real_mesh("cpu", *args, **kwargs)

    def make_engine(kind, model, tok, device, *args, **kwargs):
        if device.type == "cuda":
            claim(device.index or 0)
        return real_engine(kind, model, tok, torch.device("cpu"), *args, **kwargs)

    torch.cuda.is_available, torch.cuda.device_count = lambda: True, lambda: 2
    torch.cuda.set_device, torch.cuda.current_device = set_device, lambda: current[0]
    dist.init_process_group, device_mesh.init_device_mesh, rollout.make_engine = \
        init_process_group, init_device_mesh, make_engine


if os.environ.get("FAKE_CUDA_DIR"):
    install()
