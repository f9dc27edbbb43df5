"""eval.py: the command line of evaluation.py, the paper's six math benchmarks, for any checkpoint.

    python eval.py --model PATH_OR_HUB_ID [--preset train|justrl] [--benchmarks all] [--limit N]
    torchrun --nproc_per_node 8 eval.py --model ...       # the problems are sharded over ranks
    python eval.py --compare runs/eval_a runs/eval_b      # two results side by side
    python eval.py --model ... --judge opencompass/CompassVerifier-3B   # the rules, then a judge model
    python eval.py --judge-only --out runs/eval --judge ...   # what a failed judge left unjudged

Sampling and grading are evaluation.py's (avg@k, pass@k, the last \\boxed{}); this file holds the flags,
the results' files, and the judge: a second opinion on rejected samples, in a process of its own per rank.
"""
import argparse
import contextlib
import glob
import json
import os
import re
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoTokenizer

from evaluation import BENCHMARKS, PRESETS, EvalOptions, evaluate, summarize
from parallel import (UserError, check_out, check_shared_out, gather, init_distributed, refuse_used_out,
                      require_model, run_program)
from problems import encode_prompt, read_jsonl
from reward import judge_prompt, judge_verdict
from rollout import compute_dtype, make_engine

JUDGE_CHUNK = 256  # rejected samples per call to the judge's engine; each call's verdicts reach disk at once
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def table(rows):
    """The summary as markdown; with a judge, avg@k by the rules and by rules + judge side by side."""
    cols = [c for c in ("avg@k", "avg@k judged") if c in rows.get("average", {"avg@k": 0})]
    lines = ["| benchmark | n | k | " + " | ".join(c.replace("judged", "rule+judge") + " (%)" for c in cols) +
             " | pass@k (%) | mean length | truncated |", "|---" * (len(cols) + 6) + "|"]
    for n, r in rows.items():
        avgs = " | ".join(f"{r[c]:.2f}" for c in cols)
        if n == "average":
            lines.append(f"| **average** | | | {avgs} | | | |")
        else:
            lines.append(f"| {n} | {r['n']} | {r['k']} | {avgs} | {r['pass@k']:.2f} | {r['mean_len']:.0f} | "
                         f"{r['truncated']:.3f} |")
    return "\n".join(lines)


def judge(records, engine, tok, template=None, max_tokens=16):
    """A second opinion on every sample the rules rejected, as JustRL grades with CompassVerifier-3B: the
    judge model reads the problem, the gold and the whole response, greedily, and only its "A" counts.
    Each sample gets `judge` (the letter; None when not asked) and `judged` (right by rules or judge)."""
    todo = [r for r in records if not r["correct"]]
    prompts = [encode_prompt(tok, judge_prompt(r["problem"], r["gold"], r["completion"], template), suffix="")
               for r in todo]
    outs = engine.generate(prompts, 1, 0.0, 1.0, max_tokens, seeds=[0] * len(prompts))
    for r, out in zip(todo, outs):
        r["judge"] = judge_verdict(tok.decode(out[0].tokens, skip_special_tokens=True))
    for r in records:
        r.setdefault("judge", None)
        r["judged"] = r["correct"] or r["judge"] == "A"


def compare(a, b):
    """Two evaluations' avg@k side by side (each an eval.py --out folder with its results.json)."""
    for d in (a, b):
        if not os.path.isfile(os.path.join(d, "results.json")):
            raise UserError(f"--compare: {d} holds no results.json (an eval.py --out folder, once its run ended)")
    ra, rb = (json.load(open(os.path.join(d, "results.json")))["table"] for d in (a, b))
    print(f"| benchmark | {a} avg@k | {b} avg@k | difference |\n|---|---|---|---|")
    for name in dict.fromkeys([*ra, *rb]):
        x, y = ra.get(name, {}).get("avg@k"), rb.get(name, {}).get("avg@k")
        diff = f"{y - x:+.2f}" if x is not None and y is not None else "n/a"
        cells = ["-" if v is None else f"{v:.2f}" for v in (x, y)]
        print(f"| {name} | {cells[0]} | {cells[1]} | {diff} |")


class HelpFormat(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help: the docstring as written, and each flag's default."""


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormat)
    p.add_argument("--model", help="the policy to evaluate: a Hub id or a folder (stapo.py writes OUT/model)")
    p.add_argument("--benchmarks", default="all", help="comma list of " + ",".join(BENCHMARKS) + ", or all")
    p.add_argument("--preset", default="train", choices=list(PRESETS),
                   help="(temperature, top-p): train (1.0, 1.0) or justrl (0.7, 0.9)")
    p.add_argument("--samples", type=int, help="k for every benchmark (default: 32 AIME/AMC, 4 others)")
    p.add_argument("--temperature", type=float, help="overrides the preset's temperature")
    p.add_argument("--top-p", type=float, help="overrides the preset's top-p")
    p.add_argument("--max-tokens", type=int, default=20480, help="the response limit, in tokens")
    p.add_argument("--limit", type=int, help="first N problems of each benchmark")
    p.add_argument("--data-dir", help="read <name>.jsonl files here instead of the Hub")
    p.add_argument("--source", action="append", default=[], metavar="NAME=FILE",
                   help="a benchmark from a local .jsonl/.parquet in our, the Hub's or verl's layout "
                        "(repeatable)")
    p.add_argument("--unboxed", action="store_true",
                   help="also grade unboxed final answers (not the paper's)")
    p.add_argument("--judge", metavar="MODEL",
                   help="a judge for what the rules reject: opencompass/CompassVerifier-3B")
    p.add_argument("--judge-prompt", metavar="FILE",
                   help="the judge's template (reward.JUDGE_PROMPT's fields)")
    p.add_argument("--judge-max-tokens", type=int, default=16, help="the judge's answer limit, in tokens")
    p.add_argument("--judge-only", action="store_true",
                   help="no sampling: judge the rejected samples of --out's samples.jsonl that have no verdict")
    p.add_argument("--judge-shard", metavar="R/W", help="internal: a judge process's share (one per rank)")
    p.add_argument("--out", default="runs/eval", help="samples.jsonl, summary.md and results.json go here")
    p.add_argument("--engine", default="auto", choices=["auto", "vllm", "hf"],
                   help="vLLM, or a transformers decode loop (auto: vLLM on CUDA)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="the engines' weights (auto: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="vLLM's share of the GPU")
    p.add_argument("--judge-gpu-memory-utilization", type=float, default=0.5,
                   help="the judge's share of the GPU, in its own process while the policy's engine sleeps")
    p.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                   help="the prompt as plain text, not a user turn of the chat template")
    p.add_argument("--enable-thinking", action="store_true", help="Qwen3's chat template in thinking mode")
    p.add_argument("--seed", type=int, default=0, help="every problem's samples are seeded from it")
    p.add_argument("--compare", nargs=2, metavar=("OUT_A", "OUT_B"), help="two results side by side")
    p.print_usage = lambda file=None: None  # a wrong flag is one line, as any user error (--help lists all)
    return p


def main(argv=None):
    p = parser()
    a = p.parse_args(argv)
    if a.compare:
        return compare(*a.compare)
    if not (a.model or a.judge_only and a.judge or a.judge_shard):
        p.error("--model is required (or --compare OUT_A OUT_B, or --judge-only with --judge MODEL)")
    for flag, model in (("--model", a.model), ("--judge", a.judge)):
        if model:
            require_model(model, flag)
    if a.judge_prompt and not os.path.isfile(a.judge_prompt):  # else read only in the judges, after sampling
        p.error(f"--judge-prompt {a.judge_prompt}: no such file (a template with {{question}}, "
                "{gold_answer} and {llm_response})")
    names = list(BENCHMARKS) if a.benchmarks == "all" else a.benchmarks.split(",")
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        p.error(f"--benchmarks: unknown {unknown}; choose from {list(BENCHMARKS)}")
    temperature, top_p = PRESETS[a.preset]  # a flag given overrides its preset
    temperature = temperature if a.temperature is None else a.temperature
    top_p = top_p if a.top_p is None else a.top_p
    a.sources = dict(x.split("=", 1) for x in a.source if "=" in x)
    if len(a.sources) != len(a.source) or any(n not in BENCHMARKS for n in a.sources):
        p.error(f"--source: expected NAME=FILE with NAME one of {list(BENCHMARKS)}, got {a.source}")
    for flag, value, ok, must in (("--samples", a.samples, lambda v: v >= 1, "at least 1"),
                                  ("--limit", a.limit, lambda v: v >= 1, "at least 1"),
                                  ("--max-tokens", a.max_tokens, lambda v: v >= 1, "at least 1"),
                                  ("--temperature", temperature, lambda v: v >= 0, "at least 0 (0: greedy)"),
                                  ("--top-p", top_p, lambda v: 0 < v <= 1, "in (0, 1]")):
        if value is not None and not ok(value):
            p.error(f"{flag} {value}: must be {must}")
    if not a.judge_shard:
        check_out(a.out)  # before any model is read
    rank, world, device, _ = init_distributed(use_cuda=not a.judge_only)  # --judge-only: CUDA in its judges only
    judge_share(a, device) if a.judge_shard else run(a, names, temperature, top_p, rank, world, device)


def load_engine(a, model, device, max_model_len, memory):
    """A model's tokenizer and inference engine, its context capped at the model's own."""
    tok = AutoTokenizer.from_pretrained(model)
    longest = getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", None) or max_model_len
    context = min(max_model_len, longest)
    engine = make_engine(a.engine, model, tok, device, context, memory, for_training=False,
                         dtype=compute_dtype(a.dtype, device))
    return tok, engine


def run(a, names, temperature, top_p, rank, world, device):
    """Sample and grade by the rules (not with --judge-only); with --judge, then a judge process per rank. The
    engine is closed last, after every rank's last collective (a vLLM engine's shutdown destroys the group)."""
    engine = None
    try:
        if not a.judge_only:
            held = "an evaluation in samples.jsonl" if os.path.exists(os.path.join(a.out, "samples.jsonl")) else None
            refuse_used_out(a.out, held, "Write this evaluation to another --out; to judge that one's samples: "
                            "--judge-only --judge MODEL")
            if a.judge:
                refuse_exclusive_gpus(a, rank, device)
            tok, engine = load_engine(a, a.model, device, a.max_tokens + 2048, a.gpu_memory_utilization)
            t0 = time.time()
            opts = EvalOptions(a.samples, temperature, top_p, a.max_tokens, a.data_dir, a.limit, a.chat_template,
                               a.enable_thinking, a.seed, a.sources, a.unboxed)
            mine = evaluate(engine, tok, names, opts, rank, world)
            seconds, records, pids = time.time() - t0, sum(gather(mine), []), gather(os.getpid())
            if rank == 0:
                for old in glob.glob(os.path.join(a.out, "judged.*.jsonl")):  # verdicts on an earlier run's samples
                    os.remove(old)
                write_results(a.out, records, {"model": a.model, "preset": a.preset, "config": vars(a),
                                               "samples_per_s": len(records) / seconds,
                                               "tokens_per_s": sum(r["length"] for r in records) / seconds,
                                               "sampler_pids": pids})
        if a.judge:
            if engine:
                engine.sleep()  # on GPU, vLLM gives its weights and KV cache back for the judge's process
            check_shared_out(a.out, rank)  # every rank done generating, and its judge process sees samples.jsonl
            failed = [r for r, code in enumerate(gather(spawn_judge(a, rank, world))) if code]
            missing = gather(merge_verdicts(a.out, a.judge) if rank == 0 else 0)[0]
            if failed or missing:  # the same on every rank
                raise SystemExit(1 if rank else f"eval.py: the judge's process failed on rank(s) {failed} (its output "
                                 f"is above): {missing} rejected samples have no verdict. {a.out}/samples.jsonl keeps "
                                 f"every sample and rule verdict; to judge the rest: python eval.py --judge-only --out "
                                 f"{a.out} --judge {a.judge}")
        dist.barrier()  # all ranks done, engines alive (a vLLM engine's shutdown destroys the group), then close
    finally:
        if engine:
            engine.close()


MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # MPS's default, where CUDA_MPS_PIPE_DIRECTORY is unset


def nvidia_smi(*args):
    """nvidia-smi's lines (it makes no CUDA context), or None where it is absent or fails."""
    try:
        out = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.splitlines() if out.returncode == 0 else None


def node_gpus():
    """The node's GPUs, in PCI bus order: {uuid, index (nvidia-smi's), mode (compute mode), name} each; and
    {MIG device UUID: its GPU's UUID}, asked of `nvidia-smi -L` only when CUDA_VISIBLE_DEVICES names one."""
    query = nvidia_smi("--query-gpu=uuid,index,pci.bus_id,compute_mode,name", "--format=csv,noheader")
    rows = sorted((row for row in (line.split(", ", 4) for line in query or []) if len(row) == 5),
                  key=lambda row: row[2].lower())
    gpus = [dict(uuid=row[0], index=row[1], mode=row[3], name=row[4]) for row in rows]
    migs, parent = {}, None
    listed = nvidia_smi("-L") if "MIG-" in os.environ.get("CUDA_VISIBLE_DEVICES", "") else None
    for line in listed or []:  # "GPU 0: ... (UUID: GPU-...)", then its "  MIG ... (UUID: MIG-...)" lines
        uuid = re.search(r"\(UUID: ((GPU|MIG)-[^)]+)\)", line)
        if uuid and uuid[2] == "GPU":
            parent = uuid[1]
        elif uuid:
            migs[uuid[1]] = parent
    return gpus, migs


def visible_gpus(gpus, migs):
    """The GPUs CUDA enumerates, in its order, from CUDA_VISIBLE_DEVICES read as CUDA reads it: a comma list
    of indices, GPU UUIDs or MIG device UUIDs (MIG-<uuid>, or the older MIG-GPU-<uuid>/<gi>/<ci>), a UUID
    also as any prefix that names one device; the first entry that names none ends the list. Unset: every
    GPU. An index counts in CUDA's order: PCI bus order under CUDA_DEVICE_ORDER=PCI_BUS_ID, else fastest
    first, by a heuristic nvidia-smi cannot replay. On GPUs all of one name that is PCI order (as vLLM takes
    it, platforms/cuda.py); on mixed ones an index gives None: unknown. A MIG device counts as its GPU."""
    entries = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [str(i) for i in range(len(gpus))] if entries is None else entries.split(",")
    pci_order = os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID" or len({g["name"] for g in gpus}) <= 1
    by_uuid = {g["uuid"]: g for g in gpus}
    visible = []
    for entry in (e.strip() for e in entries):
        if entry.startswith("MIG-GPU-"):  # the older form names its GPU
            entry = entry[4:].split("/")[0]
        if entry.startswith("MIG-"):  # the GPU of each MIG device the entry names
            named = [gpu for mig, gpu in migs.items() if mig.startswith(entry)]
        else:
            named = [uuid for uuid in by_uuid if entry.startswith("GPU-") and uuid.startswith(entry)]
        if entry.isdigit() and int(entry) < len(gpus):
            visible.append(gpus[int(entry)] if pci_order else None)
        elif len(named) == 1 and named[0] in by_uuid:
            visible.append(by_uuid[named[0]])
        else:
            break
    return visible


def mps_pipe():
    """The MPS control daemon's pipe directory, where its control pipe is (CUDA's driver connects a process
    there at its first CUDA call: MPS's clients share its server's one context), else None."""
    where = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DIRECTORY
    return where if os.path.exists(os.path.join(where, "control")) else None


def gpu_mode(local):
    """What --judge meets on this rank's GPU, the visible device `local` (its LOCAL_RANK, as
    init_distributed picks it): (verdict, words). The verdict is "exclusive" (EXCLUSIVE_PROCESS, one CUDA
    context per GPU; the deprecated EXCLUSIVE_THREAD too), "unknown" (CUDA's order of unlike GPUs, which
    disagree on their mode), "mps" (either, with an MPS control daemon) or "ok", also where nvidia-smi is
    absent or fails, or does not list the GPU."""
    gpus, migs = node_gpus()
    visible = visible_gpus(gpus, migs)
    if local >= len(visible):
        return "ok", None
    candidates = [visible[local]] if visible[local] else gpus
    exclusive = [g for g in candidates if g["mode"].strip().lower().startswith("exclusive")]
    if not exclusive:
        return "ok", None
    verdict = "exclusive" if len(exclusive) == len(candidates) else "unknown"
    named = (g["index"] if verdict == "exclusive" else f"{g['index']} ({g['uuid']})" for g in exclusive)
    words = ", ".join(named)
    return ("mps", f"{words} (MPS pipe {mps_pipe()})") if mps_pipe() else (verdict, words)


def refuse_exclusive_gpus(a, rank, device):
    """--judge after sampling, on a GPU that allows one CUDA context: this process's context lives as long as
    the process (CUDA cannot release it in-process), so its judge's process could not get one. Each rank
    checks its own GPU; refused on every rank, before anything is generated. With MPS it goes ahead."""
    found = gather(gpu_mode(device.index or 0) if device.type == "cuda" else ("ok", None))
    said = {verdict: sorted({words for v, words in found if v == verdict}) for verdict, _ in found}
    ways_out = ("Nothing was generated. Either switch the GPUs to the default mode (nvidia-smi -c DEFAULT, "
                "as root) and run this again, or evaluate without --judge and judge in a later run, which "
                f"never touches CUDA but in its judge's process: python eval.py --judge-only --out {a.out} "
                f"--judge {a.judge}")
    if "exclusive" in said:
        raise SystemExit(1 if rank else f"eval.py --judge: GPU(s) {', '.join(said['exclusive'])} are in "
                         "EXCLUSIVE_PROCESS compute mode, which allows one CUDA context per GPU. The "
                         "sampling engine's process keeps its context to its end, so a judge's process "
                         f"could not start beside it. {ways_out}")
    if "unknown" in said:
        raise SystemExit(1 if rank else "eval.py --judge: which GPU is a rank's cannot be told, and it "
                         f"matters: GPU(s) {'; '.join(said['unknown'])} of this node are in "
                         "EXCLUSIVE_PROCESS compute mode (one CUDA context per GPU), others not. "
                         "CUDA_VISIBLE_DEVICES names GPUs by CUDA's index (or is unset), and CUDA orders "
                         "GPUs of different kinds fastest first, not as nvidia-smi does. Set "
                         "CUDA_DEVICE_ORDER=PCI_BUS_ID, or name the GPUs by UUID in CUDA_VISIBLE_DEVICES "
                         f"(nvidia-smi -L lists them), and run this again. {ways_out}")
    if "mps" in said and rank == 0:
        print(f"eval.py --judge: GPU(s) {'; '.join(said['mps'])}: EXCLUSIVE_PROCESS compute mode with an "
              "MPS control daemon, whose clients share one context; the judge's process can start: going "
              "ahead", file=sys.stderr, flush=True)


def write_results(out, records, results):
    """samples.jsonl, summary.md and results.json (the records' table), each whole or not at all."""
    rows = summarize(records)
    os.makedirs(out, exist_ok=True)
    files = {"samples.jsonl": "".join(json.dumps(r) + "\n" for r in records), "summary.md": table(rows) + "\n",
             "results.json": json.dumps({**results, "table": rows}, indent=1)}
    for name, text in files.items():
        with open(os.path.join(out, name + ".tmp"), "w") as f:
            f.write(text)
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
    print(table(rows))


def sample_key(r):
    return r["benchmark"], r["id"], r["sample"]


def spawn_judge(a, rank, world):
    """This rank's judge process (`--judge-shard rank/world`), a world of one on this rank's GPU (LOCAL_RANK's,
    as init_distributed picks it; found without a CUDA call), its exit code. vLLM keeps process-wide state for
    one engine: the judge's never shares the policy's process."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV and not k.startswith("TORCHELASTIC")}
    gpu, visible = int(os.environ.get("LOCAL_RANK", 0)), os.environ.get("CUDA_VISIBLE_DEVICES")
    if torch.cuda.is_available():  # the child sees this rank's GPU alone
        env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[gpu] if visible else str(gpu)
    flags = ["--judge", a.judge, "--out", a.out, "--engine", a.engine, "--dtype", a.dtype, "--judge-max-tokens",
             str(a.judge_max_tokens), "--judge-gpu-memory-utilization", str(a.judge_gpu_memory_utilization)]
    flags += ["--judge-prompt", a.judge_prompt] if a.judge_prompt else []
    cmd = [sys.executable, os.path.abspath(__file__), "--judge-shard", f"{rank}/{world}", *flags]
    return subprocess.run(cmd, env=env).returncode


def judge_share(a, device):
    """`--judge-shard R/W`: lines R, R + W, ... of samples.jsonl, their rejected samples without a verdict,
    JUDGE_CHUNK at a time; each chunk's verdicts go to judged.R.jsonl at once (a crash loses none made)."""
    part, parts = map(int, a.judge_shard.split("/"))
    done = read_verdicts(a.out)
    records = [r for _, r in read_jsonl(os.path.join(a.out, "samples.jsonl"))][part::parts]
    todo = [r for r in records if not r["correct"] and sample_key(r) not in done]
    if not todo:
        return
    tok, engine = load_engine(a, a.judge, device, 1 << 20, a.judge_gpu_memory_utilization)
    template = open(a.judge_prompt).read() if a.judge_prompt else None
    print(f"eval.py judge {a.judge_shard}: {len(todo)} samples, its engine in process {os.getpid()}", flush=True)
    try:
        with open(os.path.join(a.out, f"judged.{part}.jsonl"), "a") as f:
            f.write("\n")  # ends a line that a killed judge process left half written
            for i in range(0, len(todo), JUDGE_CHUNK):
                chunk, t0 = todo[i:i + JUDGE_CHUNK], time.time()
                judge(chunk, engine, tok, template, a.judge_max_tokens)
                s = (time.time() - t0) / len(chunk)
                f.writelines(json.dumps({"benchmark": r["benchmark"], "id": r["id"], "sample": r["sample"],
                                         "judge": r["judge"], "s": s, "pid": os.getpid()}) + "\n" for r in chunk)
                f.flush()
    finally:  # a world of one: nothing to wait for
        engine.close()


def read_verdicts(out):
    """{sample key: verdict} from judged.*.jsonl; a line a killed process left half written is judged again."""
    verdicts = {}
    for line in [line for path in glob.glob(os.path.join(out, "judged.*.jsonl")) for line in open(path)]:
        with contextlib.suppress(ValueError):  # a blank line, or one half written
            verdict = json.loads(line)
            verdicts[sample_key(verdict)] = verdict
    return verdicts


def merge_verdicts(out, judge_model):
    """Rank 0, after the judge processes: their verdicts into samples.jsonl, summary.md and results.json, once
    every rejected sample has one (until then the results stay the rules' alone); how many lack one."""
    records = [r for _, r in read_jsonl(os.path.join(out, "samples.jsonl"))]
    verdicts = read_verdicts(out)
    rejected = [verdicts.get(sample_key(r)) for r in records if not r["correct"]]
    if None in rejected:
        return rejected.count(None)
    for r in records:
        r["judge"] = None if r["correct"] else verdicts[sample_key(r)]["judge"]
        r["judged"] = r["correct"] or r["judge"] == "A"
    results = json.load(open(os.path.join(out, "results.json")))
    results["judge"], results["judge_pids"] = judge_model, sorted({v["pid"] for v in rejected})
    results["judge_s_per_judged_sample"] = sum(v["s"] for v in rejected) / max(1, len(rejected))
    write_results(out, records, results)
    return 0


if __name__ == "__main__":
    run_program(main)
