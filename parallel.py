"""parallel.py: the process group. Ranks and the device mesh, collectives of a few numbers or objects, the
check that every rank sees the same --out, the refusal of a used one, and the user's errors: one line each.
"""
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


class UserError(ValueError):
    """A mistake in what the user gave: a flag's value, a path, a line of a data file. Its message names
    it and what to do; run_program prints that alone."""


def run_program(main):
    """A program's main(): a UserError ends it with its message, printed once (by rank 0), and exit code 2,
    with no traceback; Ctrl-C where the program does not catch it (before a run's first step, say) ends it
    in one line too, exit code 130; any other exception keeps its traceback. The process group is destroyed
    either way."""
    try:
        return main()
    except UserError as e:
        say(f"error: {e}")
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        say("stopped by Ctrl-C")
        raise SystemExit(130) from None
    finally:  # a process group alive at exit can abort the process
        if dist.is_initialized():
            dist.destroy_process_group()


def say(line):
    """One line on stderr from rank 0, named for the program."""
    if (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))) == 0:
        print(f"{os.path.basename(sys.argv[0])}: {line}", file=sys.stderr, flush=True)


def require_model(path, flag="--model"):
    """A model given as a local path must be a folder there (transformers would read a missing one as a Hub id
    and answer about the id's characters). A Hub id is org/name."""
    local = path.startswith(("/", ".", "~")) or path.count("/") > 1 or os.path.exists(path)
    if local and not os.path.isdir(os.path.expanduser(path)):
        raise UserError(f"{flag} {path}: no such folder (a model here is a folder with config.json; "
                        "from the Hub, an id such as Qwen/Qwen3-8B-Base)")


def init_distributed(use_cuda=True):
    """torchrun's env, or a lone process as a world of one. Returns rank, world size, device, mesh.
    use_cuda=False: the CPU and gloo alone, and no CUDA call. On GPU, gloo carries the CPU tensors (counts,
    metrics) and NCCL the CUDA ones, with a timeout long enough for a rank to wait out another's long rollout
    or checkpoint write. On one node the mesh is 1-D (FSDP over every rank); on several it is 2-D, (nodes,
    ranks per node): HSDP shards within a node and replicates across nodes, so only the gradient all-reduce
    crosses the slower link."""
    cuda = use_cuda and torch.cuda.is_available()
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        if "RANK" in os.environ:
            refuse_restarts_on_the_agents_store()
            dist.init_process_group(backend, timeout=timedelta(hours=2))
        else:  # a plain `python stapo.py` (port 0: the OS picks a free one)
            dist.init_process_group(backend, init_method="tcp://127.0.0.1:0", rank=0, world_size=1,
                                    timeout=timedelta(hours=2))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_node == world:
        return dist.get_rank(), world, device, init_device_mesh(device.type, (world,))
    shape, names = (world // per_node, per_node), ("replicate", "shard")
    return dist.get_rank(), world, device, init_device_mesh(device.type, shape, mesh_dim_names=names)


def gather(obj):
    """Every rank's obj, in rank order."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def all_reduce_numbers(*xs, op=dist.ReduceOp.SUM):
    """A few numbers reduced over ranks (summed, or `op`): a CPU tensor, which gloo carries also on GPU."""
    t = torch.tensor([float(x) for x in xs], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()


def gather_cat(x):
    """Concatenate a 1-D tensor of any length from every rank."""
    return torch.cat(gather(x.cpu()))


def full_tensor(x):
    """The whole of a tensor FSDP2 shards over ranks (a DTensor: a collective), or x itself."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def require_shared(sees, out, what):
    """Stop every rank at once (no rank is left waiting in a collective) if one `sees` not: a user's error."""
    blind = [r for r, ok in enumerate(gather(bool(sees))) if not ok]
    if blind:
        raise UserError(f"--out {out}: rank(s) {blind} {what}. On several nodes, --out must be "
                           "a folder every node sees (a shared filesystem): each rank writes its "
                           "shard of every checkpoint there, and --resume reads them all back")


def check_shared_out(out, rank):
    """Rank 0 writes a fresh token into --out; every rank must read it back."""
    token, path = gather(os.urandom(8).hex())[0], os.path.join(out, ".run_token")
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        with open(path, "w") as f:
            f.write(token)
    dist.barrier()
    sees = os.path.exists(path) and open(path).read() == token
    require_shared(sees, out, "cannot see what rank 0 wrote there")


def check_out(out):
    """--out must be a folder, or a path whose nearest existing folder takes a new one: tried with a folder
    made there and removed at once, so nothing is left."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out}: a file, not a folder")
    near = os.path.abspath(out)
    while not os.path.exists(near):
        near = os.path.dirname(near)
    try:
        os.rmdir(tempfile.mkdtemp(dir=near))
    except OSError as e:
        raise UserError(f"--out {out}: cannot be written ({near}: {e.strerror})") from None


def refuse_used_out(out, held, ways):
    """Stop every rank at once (none is left in a collective), before anything is written to `out`, if rank 0
    found it in use: `held` says what it holds, in words (None: nothing); `ways`, what to do instead."""
    held = gather(held)[0]
    if held:
        raise UserError(f"--out {out} already holds {held}. {ways}. Nothing in {out} was changed.")


def refuse_restarts_on_the_agents_store():
    """torchrun --max-restarts N: torch 2.13's agent keeps one store for every attempt (its static rendezvous
    always; its c10d one unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), and a restarted rank can read the last
    attempt's addresses there. On gloo, 6 of 10 restarts of tests/test_resume.py's SIGKILL run hung or failed
    at their start; with the variable set, each attempt gets a store of its own, and 10 of 10 passed."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise RuntimeError(f"torchrun --max-restarts {restarts}: launch it with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                           "and the c10d rendezvous (--standalone, or --rdzv-backend c10d), or a restarted rank may "
                           "hang at its start: torch 2.13's agent keeps one store across restarts, where a restarted "
                           "rank reads the last attempt's addresses (docs/training.md: elastic restarts)")
