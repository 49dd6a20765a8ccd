"""Sandbox executions per second against the number of workers, for each isolation level this node has.

Each execution is one HumanEval-sized program (a small function and three asserts) in a fresh sandbox::

    python benchmarks/sandbox_throughput.py --workers 1 2 4 --num-runs 64

Prints one line per (level, workers): executions/s and the median wall time of one execution. The throughput
is bounded by the CPUs: start-up of a process (and of bwrap's namespaces) dominates a program this small.
"""

from __future__ import annotations

import argparse
import statistics
import time

from hpc_rlhf.sandbox.isolation import SandboxUnavailableError
from hpc_rlhf.sandbox.local import LocalSandbox
from hpc_rlhf.sandbox.result import ExecRequest

PROGRAM = """\
def add(a, b):
    return a + b

assert add(1, 2) == 3
assert add(-1, 1) == 0
assert add(10, 5) == 15
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--num-runs", type=int, default=64)
    parser.add_argument("--levels", nargs="+", default=["bwrap", "rlimits"])
    args = parser.parse_args()
    requests = [ExecRequest(code=PROGRAM)] * args.num_runs
    for level in args.levels:
        for workers in args.workers:
            try:
                sandbox = LocalSandbox(level, max_workers=workers)
            except SandboxUnavailableError as exc:
                print(f"{level}: unavailable ({exc})")
                break
            sandbox.run_many(requests[:workers])  # warm the page cache
            start = time.perf_counter()
            results = sandbox.run_many(requests)
            elapsed = time.perf_counter() - start
            bad = [r.status for r in results if r.status != "ok"]
            if bad:
                raise SystemExit(f"{level}: {len(bad)} executions failed: {sorted(set(bad))}")
            median_ms = 1000 * statistics.median(r.wall_s for r in results)
            print(f"level={level:8s} workers={workers:2d} executions/s={args.num_runs / elapsed:7.1f} "
                  f"median_run_ms={median_ms:6.1f}")


if __name__ == "__main__":
    main()
