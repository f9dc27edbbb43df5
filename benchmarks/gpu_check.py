"""The GPU check: what a lent GPU can tell about the trainer, in one call of at most 10 minutes.

    STAPO_COMMIT=<sha> python3 benchmarks/gpu_check.py --out "$OUT"  # on the GPU: BUDGET["gpu"] s at most
    python benchmarks/gpu_check.py --tiny --out /tmp/gc               # the rehearsal on CPU: tiny shapes
    python benchmarks/gpu_check.py --plan                             # the sections, caps and commands

docs/performance.md gives the device call that runs it (the wheels it carries, its timeout). The check is the data
below. SECTIONS, in priority order: each section's caps (seconds on the GPU, and in the tiny rehearsal) and its
jobs, run one after another (or all at once, where a section says together). BUDGET is the whole check's time: a
section gets its cap or what is left of the budget, whichever is less, and what a section leaves unused goes to
those after it; so what does not fit is cut from the end of the list. A job stopped at its section's cap is
"cut"; one with too little time left (under MIN_START s) is "not_run". BACKGROUND jobs (the machine's packages,
the tests' tiny Qwen3, trained on the CPU) start with the check; the sections that need one wait for it.

The preflight comes first (its cap, 20 s on the GPU): torch's version, whether torch.compile takes
recompile_limit (torch 2.11's does not), a tiny policy.build_policy(compiled=True) and one call of the head
(head.token_logprobs_and_entropy, eager: its compile is the head section's). If it fails, or runs past its cap,
the check stops: exit status 3. Otherwise the exit status is 1 when a job failed (its command exited non-zero
before its cap), 2 for a missing commit (the device gets the tree without .git: pass STAPO_COMMIT, a hex sha),
0 otherwise.

What it writes to --out (3 or 4 files; the device returns at most 8):
  <machine>-<commit>-gpu_check-<UTC time>.txt    all it printed (record.file_name's name): first line the
        provenance (metrics.provenance, and the tree's digest: --digest prints it here, to compare), then each
        job's command and output, then the summary
  <the same>.jsonl    a line per job (section, status, exit code, seconds), every JSON line the jobs printed
        (with its section and job), and the summary last
  smoke_logs.txt                      the smoke test's commands' logs, the last 60 lines of each
  recompiles_logs.txt                 the two stapo.py runs' logs under TORCH_LOGS=recompiles,graph_breaks
"""
import argparse, glob, hashlib, json, os, re, shlex, shutil, signal, subprocess, sys, tempfile, threading, time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.append(HERE)  # record.py, train_passes.py

BUDGET = {"gpu": 540, "tiny": 5400}  # seconds for the whole check: the device call's timeout_s is 600
MIN_START = {"gpu": 10, "tiny": 30}  # a job with less time left than this is not started
SIZES = {  # what the jobs' {names} stand for, by mode
    "gpu": dict(head="--batch 8 --seq 2048 --vocab 151936", h1=2048, h2=4096, shape="1.7b", compile="auto",
                passes="--samples 64 --prompt 256 --response 1024 --micro-tokens 16384 --reps 1", smoke="bf16"),
    "tiny": dict(head="--batch 2 --seq 128 --vocab 3000", h1=64, h2=96, shape="tiny", compile="on",
                 passes="--samples 16 --prompt 16 --response 32 --micro-tokens 1024 --reps 1", smoke="auto"),
}
LEVERS = ("no_checkpointing,micro_tokens_x2,selective_checkpointing,no_checkpointing+micro_tokens_x2,"
          "micro_tokens_x4,eager_layers")  # those that may reach 35% MFU first; the last decide nothing
PASSES = ("{py} benchmarks/train_passes.py --shape {shape} {passes} --model-dir {work}/model_{shape} "
          "--compile-layers {compile} --results none")
STAPO = ("{py} stapo.py --model {work}/toy/model --dataset {work}/toy/train.jsonl --steps 2 --dtype bf16 "
         "--compile-layers on --engine hf --prompts-per-step 8 --group-size 4 --minibatches 2 --micro-tokens 256 "
         "--max-prompt-len 64 --max-response-len 16 --save-every 0 --warmup-steps 0")
PYTEST = "{py} -m pytest -q -s -p no:cacheprovider {tests}"
HEAD = "{py} benchmarks/logprobs.py {head} --results none"
BACKGROUND = {
    "machine": "{py} benchmarks/gpu_check.py --machine",
    "toy": "{py} benchmarks/gpu_check.py --toy {work}/toy",
}
SECTIONS = [
    dict(name="preflight", cap=(20, 300), stop=True,
         jobs={"preflight": "{py} benchmarks/gpu_check.py --preflight --work {work}/preflight"}),
    dict(name="head", cap=(90, 300), needs="machine",  # the head against naive and TRL 1.16's fused head
         jobs={"head_{h1}": HEAD + " --hidden {h1} --variants naive,chunked{trl_head}",
               "head_{h2}": HEAD + " --hidden {h2} --variants naive,chunked"}),
    dict(name="passes", cap=(250, 1500),  # the base, the full-logits reference, the update's profile, the levers
         jobs={"passes": PASSES + " --lengths equal --phases old_pass,update,full_logits --profile update "
                                  "--levers " + LEVERS}),
    dict(name="tiny_checks", cap=(150, 2400), needs="toy", together=True,  # the tests' tiny Qwen3, on the device
         jobs={"tests_compiled_layers": PYTEST + ' -k "compiled_layers and not compute_what"',
               "tests_compiled_vs_eager": PYTEST + ' -k "compiled_layers and compute_what"',
               "tests_compiled_other": PYTEST + ' -k "compiled and not compiled_layers"',
               "recompiles_full": STAPO + " --out {work}/recompiles_full",
               "recompiles_selective": STAPO + " --checkpointing selective --out {work}/recompiles_selective",
               "smoke": "{py} examples/gpu_smoke.py --engine hf --dtype {smoke} --model {work}/toy/model --out "
                        "{work}/smoke --max-prompt-len 128 --max-tokens 16 --judge-prompt {work}/toy/judge.txt"}),
    dict(name="long_tail", cap=(130, 900),  # log-normal lengths: the trainer's cut, each lever
         jobs={"long_tail": PASSES + " --lengths lognormal --phases old_pass,update --levers no_checkpointing,"
                                     "selective_checkpointing,micro_tokens_x2,micro_tokens_x4,eager_layers"}),
    dict(name="trl_update", cap=(120, 600), needs="machine", when="trl_update",  # TRL 1.16's own update
         jobs={"trl_update": PASSES + " --lengths equal --phases trl_update"}),
]
TORCH_LOGS = {"recompiles_full": "recompiles,graph_breaks", "recompiles_selective": "recompiles,graph_breaks"}
TESTED = r"def (test_\w*compiled\w*)"  # the test files the {tests} of a pytest job are: those defining one,
NOT_TESTED = ("tests/test_benchmarks.py",)  # but the benchmarks' own tests (they run the scripts, on CPU)


# ---- the jobs the check runs in its own processes --------------------------------------------------

def preflight(work):
    """The check's first job: each step's seconds, one JSON line; an exception exits non-zero. The head runs
    eager here (its compile, tens of seconds, is the head section's): the preflight is for what breaks at once."""
    os.environ["STAPO_HEAD_COMPILE"] = "0"  # read by head.py at its import, below
    t0, steps = time.perf_counter(), {}
    import inspect
    import torch
    steps["import_torch"] = time.perf_counter() - t0
    cuda = torch.cuda.is_available()
    facts = {"torch": torch.__version__, "cuda": cuda, "gpu": torch.cuda.get_device_name() if cuda else None,
             "compile_takes_recompile_limit": "recompile_limit" in inspect.signature(torch.compile).parameters}
    print(json.dumps({"preflight": "torch", **facts}), flush=True)
    import head, parallel, policy
    from train_passes import save_random_model
    steps["import_project"] = time.perf_counter() - t0 - sum(steps.values())
    rank, world, device, mesh = parallel.init_distributed()
    save_random_model(work, "tiny", device)
    steps["model"] = time.perf_counter() - t0 - sum(steps.values())
    built = policy.build_policy(work, mesh, device, torch.bfloat16 if cuda else torch.float32, compiled=True)
    steps["build_policy_compiled"] = time.perf_counter() - t0 - sum(steps.values())
    dtype = torch.bfloat16 if cuda else torch.float32
    hidden, weight = torch.randn(256, 64, device=device, dtype=dtype), torch.randn(512, 64, device=device, dtype=dtype)
    logp, entropy = head.token_logprobs_and_entropy(hidden, weight, torch.randint(512, (256,), device=device), 1.0)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all(), "the head's log p or entropy is not finite"
    steps["head_call"] = time.perf_counter() - t0 - sum(steps.values())
    print(json.dumps({"preflight": "ok", "layers_compiled": built.layers.compiled,
                      "head_compiled": head.compiles(device), "steps_s": {k: round(v, 2) for k, v in steps.items()}}),
          flush=True)
    torch.distributed.destroy_process_group()


def machine():
    """The versions of the packages the check uses, and whether TRL's head and trainer import: one JSON line."""
    import importlib, importlib.metadata, importlib.util
    import torch
    found = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
             "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    for name in ("transformers", "triton", "datasets", "dill", "multiprocess", "pyarrow", "pandas", "xxhash",
                 "fsspec", "trl", "accelerate"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    found["vllm_importable"] = importlib.util.find_spec("vllm") is not None
    probes = {"trl_head": "import trl.kernels.chunked_logprob", "trl_update": "from trl import GRPOTrainer"}
    for probe, code in probes.items():
        try:
            exec(code)
            found["probe_" + probe] = True
        except Exception as e:  # noqa: BLE001  (any failure means: not here)
            found["probe_" + probe] = f"{type(e).__name__}: {e}"[:200]
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True) if shutil.which("nvidia-smi") else None
    found["nvidia_smi"] = smi.stdout.strip() if smi else None
    print(json.dumps({"machine": found}), flush=True)


def toy(folder):
    """The tests' tiny Qwen3 at hidden 128 (tests/reference.toy_model) and a judge prompt short enough for it."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from reference import toy_model
    os.makedirs(folder, exist_ok=True)
    toy_model(folder, hidden=128)
    with open(os.path.join(folder, "judge.txt"), "w") as f:
        f.write("Q:{question} G:{gold_answer} R:{llm_response} V:")
    print(json.dumps({"toy": folder}), flush=True)


def digest(root=ROOT):
    """sha256 of the tree's Python and shell files (each path and content; hidden folders, runs/ and out/ left
    out), 16 hex digits: the same here and on the device when the device ran this tree."""
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("runs", "out", "__pycache__"))
        for name in sorted(f for f in files if f.endswith((".py", ".sh"))):
            path = os.path.join(folder, name)
            h.update(os.path.relpath(path, root).encode() + b"\0" + open(path, "rb").read() + b"\0")
    return h.hexdigest()[:16]


# ---- the driver -------------------------------------------------------------------------------------

class Check:
    """One run of the check: its clock, its log and its JSON lines, the background jobs."""

    def __init__(self, mode, out, work):
        self.mode, self.out, self.work, self.t0 = mode, out, work, time.monotonic()
        self.lock, self.background, self.failed, self.findings = threading.Lock(), {}, [], []
        self.names = {**SIZES[mode], "py": shlex.quote(sys.executable), "work": work, "trl_head": "",
                      "tests": " ".join(test_files()) or "tests/NO_FILE_DEFINES_A_COMPILED_TEST"}

    def left(self):
        return BUDGET[self.mode] - (time.monotonic() - self.t0)

    def open_logs(self, provenance):
        import datetime
        from record import file_name
        stem = file_name(provenance, "gpu_check", datetime.datetime.now(datetime.timezone.utc))[:-len(".txt")]
        self.log, self.jsonl = (open(os.path.join(self.out, stem + ext), "w") for ext in (".txt", ".jsonl"))
        tree = digest()
        self.say(json.dumps({"results": "gpu_check", "mode": self.mode, "budget_s": BUDGET[self.mode],
                             "provenance": provenance, "tree_digest": tree}))
        self.row({"provenance": provenance, "tree_digest": tree})

    def say(self, line):
        with self.lock:
            print(line, flush=True)
            self.log.write(line + "\n")
            self.log.flush()

    def row(self, obj):
        with self.lock:
            self.jsonl.write(json.dumps(obj) + "\n")
            self.jsonl.flush()

    def argv(self, template):
        return shlex.split(template.format(**self.names))

    def start(self, name, template, stream):
        """A job's process (a session of its own: its children end with it); stream: its lines into the log as
        they come, else kept until it ends."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        if name in TORCH_LOGS:
            env["TORCH_LOGS"] = TORCH_LOGS[name]
        if name in BACKGROUND:
            env.update(OMP_NUM_THREADS="4")  # beside the timed sections: a few of the CPU's cores
        argv = self.argv(template)
        job = dict(name=name, argv=argv, lines=[], t0=time.monotonic(), stream=stream)
        job["proc"] = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, errors="replace", start_new_session=True)
        job["reader"] = threading.Thread(target=self.read, args=(job,), daemon=True)
        if stream:
            self.say(f"$ {name}: {shlex.join(argv)}")
        job["reader"].start()
        return job

    def read(self, job):
        for line in job["proc"].stdout:
            line = line.rstrip("\n").replace("\r", "\n").splitlines()[-1] if line.strip() else ""
            job["lines"].append(line)
            if job["stream"] and job["name"] not in TORCH_LOGS:
                self.say(line)
        job["t_end"] = time.monotonic()  # its output closed: it ended (a job beside others ends unwaited for)

    def finish(self, job, deadline, section):
        """Wait for a job until `deadline` (monotonic), then its status: ok, failed, or cut at its cap."""
        proc = job["proc"]
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            status = "ok" if proc.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            status = "cut"
            for sig in (signal.SIGTERM, signal.SIGKILL):  # the job's whole session: its compilers, torchrun's ranks
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=10)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
        job["reader"].join(timeout=10)
        seconds = round(job.get("t_end", time.monotonic()) - job["t0"], 1)
        if not job["stream"]:
            self.say(f"$ {job['name']}: {shlex.join(job['argv'])}")
            for line in self.shown(job):
                self.say(line)
        for line in job["lines"]:
            if line.startswith("{"):
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    continue
                self.row({"section": section, "job": job["name"], "row": obj})
                if obj.get("ran_eager_although_compiled") or "error" in obj:
                    self.findings.append(f"{job['name']}: {line[:300]}")
        end = {"section": section, "job": job["name"], "status": status, "exit": proc.returncode,
               "seconds": seconds}
        self.say(f"[{job['name']}: {status}, exit {proc.returncode}, {seconds} s]")
        self.row(end)
        if status == "failed":
            self.failed.append(job["name"])
        if job["name"] in TORCH_LOGS:
            self.recompiles(job, section)
        return status

    def shown(self, job):
        """What the log keeps of a job that ran beside others: its lines, but the TORCH_LOGS runs' (their own
        file), the progress bars and the DEBUG lines."""
        if job["name"] in TORCH_LOGS:
            return job["lines"][-15:]
        return [x for x in job["lines"] if x.strip() and not x.startswith("DEBUG") and "it/s]" not in x]

    def recompiles(self, job, section):
        """A stapo.py run under TORCH_LOGS: its recompiles by function, graph breaks, the warnings that a layer
        graph failed or a selective checkpoint is compiled, and each step's eager layer calls and probe gap."""
        text, name = "\n".join(job["lines"]), job["name"]
        with open(os.path.join(self.out, "recompiles_logs.txt"), "a") as f:
            f.write(f"==== {name}: {shlex.join(job['argv'])}\n{text[-4_000_000:]}\n")
        recompiled = {}
        for fn, where in re.findall(r"Recompiling function (\S+) in (\S+)", text):
            key = f"{fn} ({os.path.basename(where)})"
            recompiled[key] = recompiled.get(key, 0) + 1
        out = os.path.join(self.work, name, "metrics.jsonl")
        steps = [json.loads(x) for x in open(out)] if os.path.exists(out) else []
        summary = {"recompiles": name, "recompiling": recompiled,
                   "graph_break_lines": len(re.findall(r"(?i)graph break", text)),
                   "layer_compile_failed_warnings": text.count("torch.compile of a decoder layer failed"),
                   "selective_context_fn_warnings": text.count("context_fn is passed to torch.utils.checkpoint"),
                   "steps": [{k: r.get(k) for k in ("step", "eager_layer_calls", "sync_probe_gap_mean",
                                                    "sync_probe_gap", "step_s")} for r in steps]}
        self.say(json.dumps(summary))
        self.row({"section": section, "job": name, "row": summary})
        if any(r.get("eager_layer_calls") for r in steps) or summary["layer_compile_failed_warnings"]:
            self.findings.append(f"{name}: decoder-layer calls ran eager although compiled")

    def run_section(self, section):
        """A section's jobs, within its cap and the budget: the statuses of its jobs."""
        name, cap = section["name"], section["cap"][self.mode == "tiny"]
        deadline = time.monotonic() + min(cap, self.left())
        self.say(f"\n==== {name} (cap {cap} s; {self.left():.0f} s of the check's {BUDGET[self.mode]} s left)")
        if section.get("needs"):
            self.wait_background(section["needs"], deadline, name)
        if section.get("when") and self.machine.get("probe_" + section["when"]) is not True:
            self.say(f"[{name}: not run: {section['when']} does not import here: "
                     f"{self.machine.get('probe_' + section['when'])}]")
            self.row({"section": name, "status": "not_run", "why": f"no {section['when']}"})
            return ["not_run"]
        jobs, statuses = [], []
        for job, template in section["jobs"].items():
            job = job.format(**self.names)
            if deadline - time.monotonic() < MIN_START[self.mode]:
                self.say(f"[{job}: not run: {deadline - time.monotonic():.0f} s left of the section]")
                self.row({"section": name, "job": job, "status": "not_run"})
                statuses.append("not_run")
                continue
            running = self.start(job, template, stream=not section.get("together"))
            if section.get("together"):
                jobs.append(running)
            else:
                statuses.append(self.finish(running, deadline, name))
        return statuses + [self.finish(job, deadline, name) for job in jobs]

    def wait_background(self, name, deadline, section):
        job = self.background[name]
        if "status" not in job:
            job["status"] = self.finish(job, deadline, f"background ({section})")
            if name == "machine":
                found = next((json.loads(x) for x in job["lines"] if x.startswith('{"machine"')), {"machine": {}})
                self.machine = found["machine"]
                self.names["trl_head"] = ",trl" if self.machine.get("probe_trl_head") is True else ""

    def keep_smoke_logs(self):
        """The smoke test's commands' logs (examples/gpu_smoke.py writes one per command), the last 60 lines each."""
        logs = sorted(glob.glob(os.path.join(self.work, "smoke", "*.log")))
        if logs:
            with open(os.path.join(self.out, "smoke_logs.txt"), "w") as f:
                for path in logs:
                    tail = open(path, errors="replace").readlines()[-60:]
                    f.write(f"==== {os.path.basename(path)}\n" + "".join(tail))

    def run(self):
        from metrics import provenance
        self.machine = {}
        for name, template in BACKGROUND.items():
            self.background[name] = self.start(name, template, stream=False)
        self.open_logs(provenance())
        results = {}
        for section in SECTIONS:
            results[section["name"]] = statuses = self.run_section(section)
            if section.get("stop") and statuses != ["ok"]:
                self.say(f"[the preflight did not pass ({statuses[0]}): the check stops here]")
                break
        for name, job in self.background.items():  # those no section waited for
            if "status" not in job:
                job["status"] = self.finish(job, time.monotonic() + 5, "background")
        self.keep_smoke_logs()
        status = 3 if results["preflight"] != ["ok"] else 1 if self.failed else 0
        summary = {"summary": "gpu_check", "exit": status, "seconds": round(time.monotonic() - self.t0, 1),
                   "sections": {k: v for k, v in results.items()}, "failed": self.failed, "findings": self.findings,
                   "not_reached": [s["name"] for s in SECTIONS if s["name"] not in results]}
        self.say("\n==== summary\n" + json.dumps(summary))
        self.row(summary)
        return status


def test_files():
    """The test files that define a compiled-path test (TESTED): the pytest jobs' {tests}."""
    files = sorted(glob.glob(os.path.join(ROOT, "tests", "test_*.py")))
    found = [os.path.relpath(p, ROOT) for p in files if re.search(TESTED, open(p).read())]
    return [p for p in found if p not in NOT_TESTED]


def plan(mode):
    """The check as data: one JSON line per section, its cap here and its jobs' commands."""
    names = {**SIZES[mode], "py": "python3", "work": "WORK", "trl_head": "[,trl]", "tests": " ".join(test_files())}
    for s in SECTIONS:
        print(json.dumps({"section": s["name"], "cap_s": s["cap"][mode == "tiny"], "needs": s.get("needs"),
                          "together": bool(s.get("together")), "stop_on_failure": bool(s.get("stop")),
                          "jobs": {k.format(**names): v.format(**names) for k, v in s["jobs"].items()}}))
    print(json.dumps({"budget_s": BUDGET[mode], "min_start_s": MIN_START[mode],
                      "background": {k: v.format(**names) for k, v in BACKGROUND.items()}}))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="the folder its files are written to (on the device: $OUT)")
    p.add_argument("--tiny", action="store_true", default=bool(os.environ.get("GPU_CHECK_TINY")),
                   help="the CPU rehearsal: tiny shapes and their caps (also GPU_CHECK_TINY=1)")
    p.add_argument("--plan", action="store_true", help="print the sections, their caps and commands; run nothing")
    p.add_argument("--digest", action="store_true", help="print the tree's digest, as the log's header gives it")
    p.add_argument("--preflight", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--machine", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--toy", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    mode = "tiny" if a.tiny else "gpu"
    if a.preflight:
        return preflight(a.work)
    if a.machine:
        return machine()
    if a.toy:
        return toy(a.toy)
    if a.digest:
        return print(digest())
    if a.plan:
        return plan(mode)
    if not a.out:
        p.error("--out FOLDER is needed (on the device: $OUT)")
    commit = os.environ.get("STAPO_COMMIT") or subprocess.run(
        ["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if not re.fullmatch(r"[0-9a-f]{7,40}", commit):
        print(f"gpu_check.py: no commit ({commit!r}): the tree has no .git here; pass STAPO_COMMIT=<sha>, the commit "
              "the tree is at", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpu_check_")  # the jobs' models and runs; what is kept goes to --out
    try:
        return Check(mode, os.path.abspath(a.out), work).run()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
