#!/usr/bin/env python3
"""tools/gpu-lease.sh's plan adds up: a lease's calls fit the device time they are given.

Usage: gpu_lease_budget.py TOOLS_DIR

From the plan (`gpu-lease.sh plan-table`) and its budget (`gpu-lease.sh budget`):
- every phase's step limits sum to at most the phase's seconds, so each step gets its whole
  limit (none is cut short or left "not run" by the steps before it);
- every call (its phases, each with the kit's unpacking and report, and the call's packing)
  is at most the call limit, 9 minutes;
- the start-up and the calls are at most the lease, 13 minutes (of the 15 of device time);
- every step named exists in that phase of gpu-validate.sh, in the order the phase runs them
  (a name --only does not know would be skipped in silence), and no step is planned twice.
Exit 0 when all hold, 1 otherwise.
"""
import re
import subprocess
import sys


def steps_by_phase(validate_sh):
    """The steps of run_check, run_sanitize and run_perf in the order the phase runs them."""
    text = open(validate_sh).read()
    out = {}
    for phase in ("check", "sanitize", "perf"):
        body = re.search(r"^run_%s\(\) \{\n(.*?)^\}" % phase, text, re.S | re.M)
        # `step NAME LIMIT ...` at a line's start (or after a `[ ... ] &&` guard).
        names = re.findall(r"^\s*(?:\[.*\] &&\s*)?step ([a-z0-9.-]+) \d+ ", body.group(1), re.M) if body else []
        out[phase] = names
    return out


def main():
    tools = sys.argv[1]
    lease = f"{tools}/gpu-lease.sh"
    budget = subprocess.run(["bash", lease, "budget"], check=True, capture_output=True, text=True).stdout
    lease_s, startup_s, call_max_s, phase_overhead_s, call_overhead_s = map(int, budget.split())
    table = subprocess.run(["bash", lease, "plan-table"], check=True, capture_output=True, text=True).stdout
    known = steps_by_phase(f"{tools}/gpu-validate.sh")
    failures = []
    calls, seen = {}, set()
    for line in table.splitlines():
        call, phase, phase_s, *steps = line.split()
        phase_s = int(phase_s)
        limits = [(name, int(s)) for name, s in (step.split("=") for step in steps)]
        total = sum(s for _, s in limits)
        print(f"{call} {phase}: steps {total} s of the phase's {phase_s} s")
        if total > phase_s:
            failures.append(f"{call} {phase}: its steps' limits sum to {total} s, more than its {phase_s} s")
        order = known.get(phase, [])
        for name, _ in limits:
            if name not in order:
                failures.append(f"{call} {phase}: no step '{name}' in gpu-validate.sh's {phase} phase")
            if (phase, name) in seen:
                failures.append(f"{call} {phase}: step '{name}' planned twice")
            seen.add((phase, name))
        ranks = [order.index(n) for n, _ in limits if n in order]
        if ranks != sorted(ranks):
            failures.append(f"{call} {phase}: the steps are not in the order the phase runs them")
        calls[call] = calls.get(call, call_overhead_s) + phase_s + phase_overhead_s
    for call, s in calls.items():
        print(f"{call}: {s} s (limit {call_max_s} s)")
        if s > call_max_s:
            failures.append(f"{call} needs {s} s, more than a call's {call_max_s} s")
    total = startup_s + sum(calls.values())
    print(f"lease: {total} s with the start-up (limit {lease_s} s)")
    if total > lease_s:
        failures.append(f"the lease needs {total} s, more than its {lease_s} s")
    if lease_s > 13 * 60 or call_max_s > 9 * 60 or len(calls) != 2:
        failures.append(f"the plan must be two calls of at most 540 s in 780 s, not {len(calls)} in {lease_s} s "
                        f"(calls {call_max_s} s)")
    # The calls the script runs are the calls of the plan, and the timeouts it prints are theirs.
    shown = subprocess.run(["bash", lease, "plan"], check=True, capture_output=True, text=True).stdout
    for call, s in calls.items():
        if f"{call}: timeout_s {s}" not in shown:
            failures.append(f"`gpu-lease.sh plan` does not print {call}'s timeout_s {s}")
    for f in failures:
        print("FAILED:", f)
    print("ok" if not failures else "FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
