#!/usr/bin/env python3
"""Per-thread CPU of running processes, sampled from /proc while a command runs.

Usage: thread_cpu.py PATTERN INTERVAL_S -- COMMAND...

Runs COMMAND; every INTERVAL_S seconds it reads /proc/<pid>/task/*/stat of every process
whose command line contains PATTERN (e.g. "transferd --host-id"), and at the end prints,
per process, the threads whose busiest interval used the most CPU (percent of one core),
with their mean over the intervals they were busy in. Issue #28: is one thread of a hop
(the socket reader, the sender) saturated while the host's other cores idle? The device
machines have no perf; /proc is enough for that question.
"""
import os
import subprocess
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")


def procs(pattern):
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if pattern in cmd and "thread_cpu.py" not in cmd:
            out[int(pid)] = cmd
    return out


def threads(pid):
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                s = f.read()
        except OSError:
            continue
        name = s[s.index("(") + 1 : s.rindex(")")]
        rest = s[s.rindex(")") + 2 :].split()
        out[int(tid)] = (name, int(rest[11]) + int(rest[12]))  # utime + stime
    return out


def main():
    pattern, interval = sys.argv[1], float(sys.argv[2])
    cmd = sys.argv[sys.argv.index("--") + 1 :]
    child = subprocess.Popen(cmd)
    last, busy, names, labels, totals = {}, {}, {}, {}, {}
    t_last = time.monotonic()
    while child.poll() is None:
        time.sleep(interval)
        now = time.monotonic()
        dt = now - t_last
        t_last = now
        for pid, cmdline in procs(pattern).items():
            labels.setdefault(pid, cmdline.split("--host-id")[-1].split()[0] if "--host-id" in cmdline else cmdline[:40])
            total = 0.0
            for tid, (name, ticks) in threads(pid).items():
                key = (pid, tid)
                names[key] = name
                if key in last:
                    pct = 100.0 * (ticks - last[key]) / HZ / dt
                    total += pct
                    if pct > 1.0:
                        busy.setdefault(key, []).append(pct)
                last[key] = ticks
            if total > 5.0:
                totals.setdefault(pid, []).append(total)
    by_pid = {}
    for (pid, tid), xs in busy.items():
        by_pid.setdefault(pid, []).append((max(xs), sum(xs) / len(xs), len(xs), tid, names[(pid, tid)]))
    for pid, rows in by_pid.items():
        rows.sort(reverse=True)
        total = sum(r[1] for r in rows)
        t = totals.get(pid, [0.0])
        print(
            f"{labels.get(pid, pid)} (pid {pid}): {len(rows)} threads busy; the process used "
            f"{max(t):.0f}% of a core at most, {sum(t) / len(t):.0f}% on average over {len(t)} busy samples"
        )
        for peak, mean, n, tid, name in rows[:8]:
            print(f"  {name:<20} tid {tid:<8} peak {peak:5.0f}%  mean {mean:5.0f}% over {n} samples")
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
