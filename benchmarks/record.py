"""record.py: each benchmark run kept as a results file, written by the script that measures.

A script adds --results (add_flag) and runs inside kept(folder, script): from then on everything it prints goes
to its terminal and to one new file, <folder>/<machine>-<commit>-<script>-<UTC time>.txt (folder:
benchmarks/results by default). The file's first line is one JSON object, {"results": script, "started": ...,
"provenance": metrics.provenance()}: the commit (git's, or STAPO_COMMIT where the tree travelled without .git),
whether the tree had uncommitted changes, the machine (CPU model, cores, GPU), torch's version and the command
line. Then come the script's lines as it printed them (its JSON lines and its tables), and last one JSON object,
{"finished": true, "seconds": ...} ({"finished": false, "error": ...} when the run raised). read(path) gives a
file back as its header, its JSON lines and its last line.
"""
import datetime
import json
import os
import re
import sys
import time
from contextlib import contextmanager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER = os.path.join(ROOT, "benchmarks", "results")


def add_flag(parser):
    """--results FOLDER|none on a benchmark's parser."""
    parser.add_argument("--results", default=FOLDER, help="the folder this run's results file is written to "
                        "(default: benchmarks/results; none: no file)")


def machine(provenance):
    """A short name of the machine: the GPU's model (h200), else the CPU's family and its cores (xeon-2c)."""
    gpu = provenance.get("gpu")
    if gpu:
        found = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]?)\b", gpu)
        return (found.group(1) if found else re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")).lower()
    cpu = (provenance.get("cpu") or "").lower()
    family = next((k for k in ("epyc", "xeon", "ryzen", "core", "apple", "neoverse", "graviton") if k in cpu),
                  "cpu")
    return f"{family}-{provenance.get('cores')}c"


def file_name(provenance, script, when):
    """<machine>-<commit, 7 characters; -dirty if the tree had changes>-<script>-<UTC time>.txt"""
    commit = (provenance.get("commit") or "nocommit")[:7] + ("-dirty" if provenance.get("dirty") else "")
    return f"{machine(provenance)}-{commit}-{script}-{when:%Y%m%d-%H%M%S}.txt"


class Tee:
    """A text stream that writes to two: the terminal's and the results file."""

    def __init__(self, stream, file):
        self.stream, self.file = stream, file

    def write(self, text):
        self.file.write(text)
        return self.stream.write(text)

    def flush(self):
        self.file.flush()
        self.stream.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding: the terminal's
        return getattr(self.stream, name)


@contextmanager
def kept(folder, script):
    """Run the block with its stdout also written to a new results file in folder (none: no file); yields the
    file's path (or None). The file is complete when its last line says finished."""
    if folder == "none":
        yield None
        return
    from metrics import provenance  # the project's: imported here, once the script has put the project on the path
    stamp, when = provenance(), datetime.datetime.now(datetime.timezone.utc)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, file_name(stamp, script, when))
    t0, out = time.perf_counter(), sys.stdout
    with open(path, "w") as f:
        f.write(json.dumps({"results": script, "started": f"{when:%Y-%m-%dT%H:%M:%SZ}", "provenance": stamp}) + "\n")
        f.flush()
        sys.stdout = Tee(out, f)
        end = {"finished": False}
        try:
            yield path
            end = {"finished": True}
        except BaseException as e:
            end = {"finished": False, "error": f"{type(e).__name__}: {e}"[:300]}
            raise
        finally:
            sys.stdout.flush()
            sys.stdout = out
            f.write(json.dumps({**end, "seconds": round(time.perf_counter() - t0, 1)}) + "\n")
            print(f"results: {path}", file=sys.stderr)


def read(path):
    """A results file: (its first line's object, the JSON lines the script printed, its last line's object, or
    None where the run was killed before it wrote one)."""
    with open(path) as f:
        header, *body = f.read().splitlines()
    rows = []
    for line in body:
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a printed line that only starts with a brace
    end = rows.pop() if rows and body[-1].startswith('{"finished"') else None
    return json.loads(header), rows, end
