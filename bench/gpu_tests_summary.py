#!/usr/bin/env python3
"""Pass / fail / skip counts per test area (the folder under tests/) of a
GoogleTest run: from the JSON reports (--gtest_output=json) in RESULTS_DIR,
one per test process (bench/gpu_suite.sh) or one per binary
(bench/gpu_check.sh). A process that left no report (a crash, a timeout) is
a failure, named from its N.name file with its exit status (N.rc). Prints
one line per area, the total, each failure (with its time) and each skip
with its reason, and the slowest tests.
Tests of RESULTS_DIR/list (bench/gpu_suite.sh) never started count as failed
(area "?"), listed together.

    bench/gpu_tests_summary.py RESULTS_DIR [--json OUT.json] [--log LOG]

Skip reasons come from N.log beside each N.json, or from LOG (the output of
a single run) where there is none.
"""
import glob
import json
import os
import re
import sys


def area_of(path):
    m = re.search(r"(?:^|/)tests/([^/]+)/", path.replace("\\/", "/"))
    return m.group(1) if m else "?"


def skip_reasons(log_path):
    """Test name -> the message GTEST_SKIP printed, from a gtest log."""
    out, msg = {}, []
    try:
        lines = open(log_path, errors="replace").read().splitlines()
    except OSError:
        return out
    in_skip = False
    for line in lines:
        m = re.match(r"\[  SKIPPED \] (\S+)", line)
        if m:
            out.setdefault(m.group(1), " ".join(msg).strip())
            msg, in_skip = [], False
        elif line.startswith("[ RUN      ]"):
            msg, in_skip = [], False
        elif re.search(r": Skipped$", line):
            in_skip = True
        elif in_skip:
            msg.append(line.strip())
    return out


def main():
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    results = sys.argv[1]
    shared_log = sys.argv[sys.argv.index("--log") + 1] if "--log" in sys.argv else None
    areas = {}  # area -> [passed, failed, skipped]
    failures, skips, not_started = [], [], []
    times = []  # (seconds, name): every test that ran
    seen = set()
    for report in sorted(glob.glob(os.path.join(results, "*.json"))):
        stem = report[: -len(".json")]
        try:
            data = json.load(open(report))
        except (OSError, ValueError) as e:
            failures.append((os.path.basename(stem), "?", "unreadable report: %s" % e))
            continue
        log = stem + ".log" if os.path.exists(stem + ".log") else shared_log
        reasons = skip_reasons(log) if log else {}
        for suite in data.get("testsuites", []):
            for t in suite.get("testsuite", []):
                name = "%s.%s" % (suite["name"], t["name"])
                if t.get("status") == "NOTRUN":
                    continue
                seen.add(name)
                secs = float(str(t.get("time", "0s")).rstrip("s") or 0)
                times.append((secs, name))
                area = area_of(t.get("file", ""))
                counts = areas.setdefault(area, [0, 0, 0])
                if t.get("failures"):
                    counts[1] += 1
                    first = t["failures"][0].get("failure", "").strip().splitlines()
                    failures.append((name, area, "%s (after %.1f s)" % (first[0] if first else "failed", secs)))
                elif t.get("result") == "SKIPPED":
                    counts[2] += 1
                    skips.append((name, area, reasons.get(name, "")))
                else:
                    counts[0] += 1
    # Processes that left no report: crashed or timed out.
    for name_file in sorted(glob.glob(os.path.join(results, "*.name"))):
        stem = name_file[: -len(".name")]
        name = open(name_file).read().strip()
        if name in seen or os.path.exists(stem + ".json"):
            continue
        seen.add(name)
        if not os.path.exists(stem + ".rc"):
            why = "not finished when the suite's time ran out"
        else:
            rc = open(stem + ".rc").read().strip()
            why = "timed out" if rc in ("124", "137") else "no report (exit status %s)" % rc
        areas.setdefault("?", [0, 0, 0])[1] += 1
        failures.append((name, "?", why))
    # Listed (RESULTS_DIR/list) and never started: the suite's time ran out.
    listed = os.path.join(results, "list")
    if os.path.exists(listed):
        for name in open(listed).read().split():
            if name not in seen:
                areas.setdefault("?", [0, 0, 0])[1] += 1
                not_started.append(name)
    total = [sum(c[i] for c in areas.values()) for i in range(3)]
    print("%-16s %7s %7s %7s" % ("area", "passed", "failed", "skipped"))
    for area in sorted(areas):
        print("%-16s %7d %7d %7d" % (area, *areas[area]))
    print("%-16s %7d %7d %7d" % ("all", *total))
    for name, area, why in failures:
        print("FAILED  %s [%s]: %s" % (name, area, why))
    if not_started:
        print("FAILED  %d tests not started: the suite's time ran out (first: %s)"
              % (len(not_started), ", ".join(not_started[:5])))
    for name, area, why in skips:
        print("SKIPPED %s [%s]: %s" % (name, area, why or "(no reason printed)"))
    for secs, name in sorted(times, reverse=True)[:10]:
        print("SLOWEST %7.1f s  %s" % (secs, name))
    if "--json" in sys.argv:
        out = sys.argv[sys.argv.index("--json") + 1]
        json.dump({"areas": {a: dict(zip(("passed", "failed", "skipped"), c))
                             for a, c in areas.items()},
                   "total": dict(zip(("passed", "failed", "skipped"), total)),
                   "failures": failures, "skips": skips, "not_started": not_started},
                  open(out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
