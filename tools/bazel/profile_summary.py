#!/usr/bin/env python3
"""Where a Bazel run's time went, from its JSON profile (`bazel ... --profile=FILE`).

  profile_summary.py PROFILE [LABEL]

Prints one row per kind of work (tests, self-containment, must-not-compile, examples, benchmarks,
the precompiled LibTorch prefix, tools) with the seconds its actions took compiling, linking,
running and otherwise (generating sources, the prefix), then the wall time. An action's seconds
are its wall time: on a loaded machine they include waiting for a core, and a test that runs two
compilers at once (//:self_contained_test) is counted once. The kind comes from the action's file or
target; for tools/ci_time and docs/ci.md.
"""

import gzip
import json
import re
import sys

KINDS = ["tests", "self-containment", "must-not-compile", "examples", "benchmarks", "LibTorch prefix",
         "tools"]
PHASES = ["compile", "link", "run", "other"]


def kind_of(subject):
    s = subject
    if "self_contained" in s:
        return "self-containment"
    if "tests/fail" in s:
        return "must-not-compile"
    if s.startswith("examples") or "//examples" in s:
        return "examples"
    if s.startswith("benchmarks") or "//benchmarks" in s:
        return "benchmarks"
    if "torch_pch" in s:
        return "LibTorch prefix"  # precompiled once for the compile-only checks
    if s.startswith("tests") or "//tests" in s:
        return "tests"
    return "tools"


def phase_and_subject(name):
    for prefix, phase in (("Compiling ", "compile"), ("Linking ", "link"), ("Testing ", "run")):
        if name.startswith(prefix):
            return phase, name[len(prefix):]
    m = re.match(r"Executing genrule (\S+)", name)
    if m:
        return "other", m.group(1).lstrip("/")
    return None, None


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    opener = gzip.open if argv[1].endswith(".gz") else open
    with opener(argv[1], "rt") as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    table = {k: {p: 0.0 for p in PHASES} for k in KINDS}
    counts = {k: {p: 0 for p in PHASES} for k in KINDS}
    start, end = None, None
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        ts, dur = e["ts"] / 1e6, e["dur"] / 1e6
        start = ts if start is None else min(start, ts)
        end = ts + dur if end is None else max(end, ts + dur)
        if e.get("cat") not in ("action processing", "test"):
            continue
        phase, subject = phase_and_subject(e.get("name", ""))
        if phase is None:
            continue
        k = kind_of(subject)
        table[k][phase] += dur
        counts[k][phase] += 1
    label = argv[2] if len(argv) > 2 else argv[1]
    print("%s: seconds by kind of target (actions in brackets)" % label)
    print("| kind | compile | link | run | other | total |")
    print("| --- | --- | --- | --- | --- | --- |")
    grand = {p: 0.0 for p in PHASES}
    for k in KINDS:
        row = table[k]
        if sum(row.values()) == 0:
            continue
        cells = ["%.0f (%d)" % (row[p], counts[k][p]) if counts[k][p] else "" for p in PHASES]
        print("| %s | %s | %.0f |" % (k, " | ".join(cells), sum(row.values())))
        for p in PHASES:
            grand[p] += row[p]
    print("| all | %s | %.0f |" % (" | ".join("%.0f" % grand[p] for p in PHASES), sum(grand.values())))
    if start is not None:
        print("wall: %.0f s" % (end - start))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
