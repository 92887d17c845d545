"""Shared by the anchor scripts: alternating rounds, process CPU time, pinning every thread to one
core, and the BLAS this process loaded. The same definitions as benchmarks/common/*.hpp, so that
the anchors' figures mean what the C++ benchmark's mean (docs/benchmarks.md)."""

import os
import statistics
import time


def median(values):
    return statistics.median(values) if values else float("nan")


def rounds(variants, n_rounds, calls=1, warmup=1):
    """Runs `variants` (name -> callable) in `n_rounds` alternating rounds; round r starts at
    variant r mod n. Returns name -> list of (wall_us, cpu_us), the medians of `calls` calls in
    each round. CPU time is the process's, all threads (time.process_time)."""
    names = list(variants)
    for name in names:
        for _ in range(warmup):
            variants[name]()
    out = {name: [] for name in names}
    for r in range(n_rounds):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            walls, cpus = [], []
            for _ in range(calls):
                c0, t0 = time.process_time(), time.perf_counter()
                variants[name]()
                walls.append((time.perf_counter() - t0) * 1e6)
                cpus.append((time.process_time() - c0) * 1e6)
            out[name].append((median(walls), median(cpus)))
    return out


def _threads():
    """This process's thread ids (only the calling thread where /proc is not mounted)."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


class PinnedToOneCore:
    """Pins every thread of this process to its first allowed core while the block runs."""

    def __enter__(self):
        self.saved = {}
        self.process_mask = os.sched_getaffinity(0)
        core = min(self.process_mask)
        for tid in _threads():
            try:
                self.saved[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, {core})
            except OSError:
                pass
        return self

    def __exit__(self, *exc):
        for tid in _threads():
            try:
                os.sched_setaffinity(tid, self.saved.get(tid, self.process_mask))
            except OSError:
                pass


def loaded_blas():
    """The BLAS libraries mapped into this process (same rule as conditions.hpp)."""
    seen = []
    try:
        lines = open("/proc/self/maps").read().splitlines()
    except OSError:
        return "unknown (no /proc)"
    for line in lines:
        path = line[line.find("/"):].strip() if "/" in line else ""
        kind = ""
        if "openblas" in path:
            kind = "openblas"
        elif "libmkl" in path:
            kind = "mkl"
        elif "/libblas.so" in path or "/libcblas.so" in path:
            kind = "reference"
        if kind and f"{kind}:{path}" not in seen:
            seen.append(f"{kind}:{path}")
    return ",".join(seen) or "none found"
