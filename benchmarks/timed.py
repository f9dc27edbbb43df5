"""timed.py: one command's wall time, kept as a results file (record.py): the README's times of `bash toy.sh`
and `bash test.sh`.

    python benchmarks/timed.py --label toy.sh -- bash toy.sh --out runs/toysh
    python benchmarks/timed.py --label test.sh -- bash .ci/run

Runs the command once, in this checkout's folder, its output passed through (and kept in the file), then prints
one JSON line: {"label", "command", "seconds", "exit", "load_before", "load_after"} (the 1-minute load average:
whether the machine was quiet). A fresh clone's first run times the install too: run this from the clone with any
Python that has torch (the provenance, the clone's commit and machine, is read with it).
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import record  # noqa: E402


def timed(command, cwd):
    """Run command (a list) in cwd, printing its output as it comes: (seconds, exit code)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        print(line, end="", flush=True)
    return time.perf_counter() - t0, proc.wait()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", required=True, help="what is timed, in the file's name (toy.sh, test.sh)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    record.add_flag(p)
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("no command: -- then the command to time")
    with record.kept(a.results, f"time-{a.label}"):
        load = os.getloadavg()[0]
        seconds, code = timed(command, record.ROOT)
        row = {"label": a.label, "command": " ".join(command), "seconds": round(seconds, 1), "exit": code,
               "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2)}
        print(json.dumps(row))
    return row


if __name__ == "__main__":
    sys.exit(main()["exit"])
