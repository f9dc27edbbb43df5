"""The first command on a new GPU node: does the whole GPU path work here? About 10 minutes.

    python examples/gpu_smoke.py                                   # Qwen/Qwen3-0.6B-Base (tied embeddings)
    python examples/gpu_smoke.py --model /path/to/any/small/model --out runs/smoke

It runs the real commands, each in its own processes, on a few arithmetic problems written to --out:
  1. stapo.py on 1 GPU for 2 steps (bf16 on CUDA), saving a checkpoint: every sync's self-check passes
     (the probe's mean and largest gap, against stapo.SYNC_TOLERANCE), and the sampler-trainer gap is logged;
  2. stapo.py on 2 GPUs (if present; else 1) resumes from that checkpoint for 2 more steps, evaluating
     (--eval-every) at the last;
  3. eval.py --judge, with the model judging itself: each rank's judge engine in a process of its own (vLLM
     keeps process-wide state for one engine), on samples one of whose golds nothing matches.
Each must exit cleanly, closing its engine: no error or traceback line in its output (a vLLM engine shut
down asleep makes CuMem print CUDA errors). It prints one PASS/FAIL line per item (SKIP for the
sampler-trainer gap with the HF engine, which reports no sampler log-probs), the peak memory of each phase
(the GPUs' used memory, polled with nvidia-smi, all processes; on CPU the processes' resident set), the
trainer's own peaks (peak_gb/*) from each run's second step (steps 2 and 4: a first step's rollout peak
holds vLLM's start-up), and "smoke: N passed, M failed" (and ", K skipped"); its exit code is M. On CPU it
runs too, with vLLM's CPU build and a tiny model: that is how the tests run it (--engine vllm --dtype bf16
...).
"""
import argparse, glob, json, os, re, shutil, subprocess, sys, threading, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def problems(n):
    return [{"id": str(i), "problem": f"What is {i % 7 + 2} + {i % 5 + 3}?", "answer": str(i % 7 + i % 5 + 5)}
            for i in range(n)]


def write_jsonl(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


class PeakMemory:
    """The peak memory while a command runs: the GPUs' used memory (nvidia-smi), or on CPU the resident
    set of the command's process tree (psutil, which vLLM installs)."""

    def __init__(self, gpus):
        self.gpus, self.peak, self.proc = gpus, 0.0, None

    def sample(self):
        if self.gpus:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout.split()
            return max(map(float, out)) / 1024 if out else 0.0
        import psutil
        try:
            tree = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
            return sum(p.memory_info().rss for p in tree) / 2**30
        except psutil.Error:
            return 0.0

    def run(self, cmd, env):
        self.peak, done = 0.0, threading.Event()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)

        def poll():
            while not done.is_set():
                self.peak = max(self.peak, self.sample())
                time.sleep(0.5)
        threading.Thread(target=poll, daemon=True).start()
        out = self.proc.communicate()[0]
        done.set()
        return self.proc.returncode, out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen/Qwen3-0.6B-Base", help="the policy (and the judge)")
    p.add_argument("--out", default="runs/smoke", help="the runs' folders go under it")
    p.add_argument("--engine", default="auto", choices=["auto", "vllm", "hf"], help="stapo.py's --engine")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="stapo.py's --dtype")
    p.add_argument("--gpus", type=int, help="ranks of the second run (default: 2 if 2 GPUs are present, else 1)")
    p.add_argument("--max-prompt-len", type=int, default=256, help="stapo.py's --max-prompt-len")
    p.add_argument("--max-tokens", type=int, default=256, help="response tokens, in training and in eval")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share of the GPU")
    p.add_argument("--judge-prompt", help="eval.py's --judge-prompt (a short one for a tiny model's context)")
    a = p.parse_args(argv)
    import torch
    gpus = torch.cuda.device_count()
    ranks = a.gpus or (2 if gpus >= 2 else 1)
    out = os.path.abspath(a.out)
    for old in ("run", "eval"):  # a fresh run: --resume must find this run's checkpoint, not an older one
        shutil.rmtree(os.path.join(out, old), ignore_errors=True)
    write_jsonl(os.path.join(out, "train.jsonl"), problems(32))
    bench = problems(4) + [{"id": "4", "problem": "What is 1 + 1?", "answer": "-7"}]  # the judge gets work
    write_jsonl(os.path.join(out, "bench", "math500.jsonl"), bench)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    run_dir = os.path.join(out, "run")
    common = ["--model", a.model, "--dataset", os.path.join(out, "train.jsonl"), "--out", run_dir,
              "--engine", a.engine, "--dtype", a.dtype, "--prompts-per-step", "4", "--group-size", "4",
              "--minibatches", "2", "--max-prompt-len", str(a.max_prompt_len), "--max-response-len",
              str(a.max_tokens), "--gpu-memory-utilization", str(a.gpu_memory_utilization), "--lr", "1e-6",
              "--warmup-steps", "0", "--save-every", "2"]
    phases = {
        "train on 1 rank, 2 steps": torchrun + ["1", "stapo.py", *common, "--steps", "2"],
        f"resume on {ranks} ranks, 2 steps, --eval-every": torchrun + [
            str(ranks), "stapo.py", *common, "--steps", "4", "--resume", "--eval-every", "4",
            "--eval-benchmarks", "math500", "--eval-data-dir", os.path.join(out, "bench"),
            "--eval-samples", "2", "--eval-max-tokens", str(a.max_tokens)],
        "eval.py --judge": torchrun + [
            str(ranks), "eval.py", "--model", os.path.join(run_dir, "model"), "--judge", a.model,
            "--engine", a.engine, "--dtype", a.dtype, "--data-dir", os.path.join(out, "bench"),
            "--benchmarks", "math500", "--samples", "2", "--max-tokens", str(a.max_tokens),
            "--gpu-memory-utilization", str(a.gpu_memory_utilization), "--judge-gpu-memory-utilization",
            str(a.gpu_memory_utilization), "--out", os.path.join(out, "eval"),
            *(["--judge-prompt", a.judge_prompt] if a.judge_prompt else [])]}
    print(f"smoke: {a.model} on {gpus or 'no'} GPU(s), torch {torch.__version__}, second run on {ranks} rank(s)")
    results, memory = [], PeakMemory(gpus)
    for name, cmd in phases.items():
        t0 = time.time()
        code, log = memory.run(cmd, env)
        with open(os.path.join(out, name.split()[0] + ".log"), "w") as f:
            f.write(log)
        print(f"  ran {name} in {time.time() - t0:.0f} s, peak memory {memory.peak:.1f} GiB "
              f"({'per GPU, nvidia-smi' if gpus else 'resident set, all its processes'}); exit {code}")
        results.append((name, code == 0, log.strip().splitlines()[-1:] if code else []))
    results += checks(run_dir, os.path.join(out, "eval"))
    for name, ok, why in results:  # ok None: the item does not apply to this engine
        verdict = "SKIP" if ok is None else "PASS" if ok else "FAIL"
        print(f"{verdict} {name}" + (f": {why}" if why and not ok else ""))
    passed, skipped = sum(bool(ok) for _, ok, _ in results), sum(ok is None for _, ok, _ in results)
    failed = len(results) - passed - skipped
    print(f"smoke: {passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
    return failed


ERROR = re.compile(r"(?i)\berror\b|traceback")  # CuMem's CUDA errors at a sleeping engine's teardown, among others
STEADY = {2: "the first run's second step, 1 rank", 4: "the resumed run's second step"}  # steps 1, 3: start-ups


def checks(run_dir, eval_dir):
    """What the logs must show, item by item."""
    import stapo
    import torch
    from rollout import compute_dtype, engine_kind
    metrics = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))] \
        if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) else []
    out = []
    config = {"dtype": "fp32", "device": "cpu", "engine": "vllm"}  # no run: the items that read its logs fail
    if metrics:
        config = json.load(open(os.path.join(run_dir, "config.json")))
    mean, top = stapo.SYNC_TOLERANCE[compute_dtype(config["dtype"], torch.device(config["device"]))]
    gaps = [(m["sync_probe_gap_mean"], m["sync_probe_gap"]) for m in metrics]
    out.append(("every sync's self-check within its tolerance", len(gaps) == 4,  # a failed check stops the run
                f"probe gaps (mean, max) per step: {gaps}; tolerance {(mean, top)}"))
    sampler = [(m["logprob_gap_mean"], m["logprob_gap_max"]) for m in metrics]
    within = [g is not None and g <= mean and x <= top for g, x in sampler]
    hf = engine_kind(config["engine"], config["device"]) == "hf"  # it reports no sampler log-probs: n/a
    out.append(("the sampler-trainer gap within the same tolerance every step",
                None if hf else bool(sampler) and all(within),
                "the HF engine reports no sampler log-probs" if hf else
                f"(mean, max) per step: {sampler}; tolerance {(mean, top)}"))
    out.append(("--resume: each step logged once", [m["step"] for m in metrics] == [1, 2, 3, 4],
                f"steps {[m['step'] for m in metrics]}"))
    out.append(("--eval-every", "eval/math500" in (metrics[-1] if metrics else {}), "no eval/math500 at step 4"))
    path = os.path.join(eval_dir, "samples.jsonl")
    samples = [json.loads(x) for x in open(path)] if os.path.exists(path) else []
    judged = bool(samples) and all("judged" in s for s in samples)
    out.append(("the judge saw every sample the rules rejected", judged, f"{len(samples)} samples"))
    path = os.path.join(eval_dir, "results.json")
    pids = json.load(open(path)) if os.path.exists(path) else {}
    own = bool(pids.get("judge_pids")) and not set(pids["judge_pids"]) & set(pids["sampler_pids"])
    out.append(("the judge's engines in processes of their own", own,
                f"judge processes {pids.get('judge_pids')}, sampling processes {pids.get('sampler_pids')}"))
    logs = sorted(glob.glob(os.path.join(os.path.dirname(run_dir), "*.log")))  # each command's stdout and stderr
    noisy = [line for path in logs for line in open(path).read().splitlines() if ERROR.search(line)]
    out.append(("clean exits: no error or traceback in any command's output (each closes its engine)",
                bool(logs) and not noisy, f"{len(noisy)} lines, the first: {noisy[:2]}"))
    steady = [m for m in metrics if m["step"] in STEADY]
    if steady:
        print("  the trainer's peak memory by phase (GiB, peak_gb/*), from each run's second step (a first step's "
              "rollout peak spans vLLM's start-up, its CUDA-graph capture and the first sync):")
    for m in steady:
        peaks = {k[8:]: round(v, 2) for k, v in m.items() if k.startswith("peak_gb/")}
        print(f"    step {m['step']}, {STEADY[m['step']]}: {peaks}")
    for m in metrics:
        gap = "none reported" if m["logprob_gap_mean"] is None else \
            f"mean {m['logprob_gap_mean']:.2e} max {m['logprob_gap_max']:.2e}"
        print(f"  step {m['step']}: probe gap mean {m['sync_probe_gap_mean']:.2e} max {m['sync_probe_gap']:.2e}, "
              f"sampler gap {gap}")
    return out


if __name__ == "__main__":
    sys.exit(main())
