"""Named mutants of the implementation, each of which the model's replay must catch.

Each mutant is a copy of ``src/fenced`` with one deliberate fault written into it (a
text replaced in the scripts or the stores; every replacement must match where it is
expected, or the mutant is refused as not applied). The replay of the model's traces
(tests/test_model_replay.py, on the traces ``spec/check.sh`` wrote to spec/traces/) is
run against the copy, until the first trace that fails (two mutants at a time); a
mutant is caught when a trace fails. A mutant that survives means the model's traces,
or the replay's comparisons, cannot see that fault: this script then exits 1.

    python spec/mutants.py             # every mutant
    python spec/mutants.py release     # the ones whose names start with "release"
    python spec/mutants.py --every     # every trace, not until the first that fails
    python spec/mutants.py --replayed  # the replay just passed on the code as it is
                                       # (make model runs it first): not again here
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "fenced"
REPLAY = "tests/test_model_replay.py"


@dataclass(frozen=True)
class Edit:
    """Replace ``old`` by ``new`` in one file, ``count`` times exactly."""

    path: str
    old: str
    new: str
    count: int = 1


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    edits: tuple[Edit, ...]


MUTANTS = (
    Mutant(
        "acquire-no-clock-floor",
        "ACQUIRE mints the last fence + 1, never the server clock: after a restart that "
        "forgot the fence key, fences start again from 1",
        (
            # The common grant writes the clock as the fence: off, so the whole script runs.
            Edit("_scripts.py", "local taken, previous, written\nif (ARGV[9] or '') == ''",
                 "local taken, previous, written\nif false and (ARGV[9] or '') == ''"),
            # The plain grant's mint: last + 1, always.
            Edit("_scripts.py", "  local minted = fence_after(last_fence)\n"
                 "  if fence_below(now, minted) then",
                 "  local minted = fence_after(last_fence)\n  if true then"),
            # The whole script's mint, and the shared one (TAKEOVER, REPLACE): no floor.
            Edit("_scripts.py", "  if fence_below(minted, now) then\n    minted = now\n",
                 "  if false then\n    minted = now\n", count=2),
        ),
    ),
    Mutant(
        "release-no-token-compare",
        "RELEASE deletes whatever lease holds the name, not only the caller's",
        (
            Edit("_scripts.py", "  if held == ARGV[1] and (ARGV[6] == '0'",
                 "  if held and (ARGV[6] == '0'"),
            Edit("_scripts.py", "if held == nil then held = redis.call('GET', KEYS[1]) end\n"
                 "if held == A[1] then",
                 "if held == nil then held = redis.call('GET', KEYS[1]) end\nif held then"),
        ),
    ),
    Mutant(
        "release-no-note",
        "RELEASE keeps no note of its answer: a retry of a release whose reply was lost "
        "answers that the lease was not released",
        (
            Edit("_scripts.py", "  local noted = redis.call('GET', KEYS[6])",
                 "  local noted = false"),
        ),
    ),
    Mutant(
        "refresh-recreates-lease",
        "REFRESH sets the caller's lease again when it is already gone (expired, or "
        "released by an operator), instead of answering that it was lost",
        (
            Edit("_scripts.py", "if redis.call('GET', KEYS[1]) == ARGV[1] then\n"
                 "  local idle = tonumber(ARGV[3] or '0')",
                 "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end\n"
                 "if redis.call('GET', KEYS[1]) == ARGV[1] then\n"
                 "  local idle = tonumber(ARGV[3] or '0')"),
        ),
    ),
    Mutant(
        "redis-pointer-accepts-lower",
        "a RedisPointer's swap accepts a fence below the one it accepted last",
        (
            Edit("store/_pointer.py", "if current and below(ARGV[2], current) then",
                 "if false and current and below(ARGV[2], current) then"),
        ),
    ),
    Mutant(
        "beat-dispatch-regrants",
        "BEAT_DISPATCH grants a due time that is not after the stored one (a tick sent "
        "twice by two leaders, or by one that read the stored due time before a pause)",
        (
            Edit("_scripts.py", "        ok = tonumber(due) >= tonumber(last) + tonumber(gap) "
                 "and tonumber(due) > tonumber(last)",
                 "        ok = true"),
        ),
    ),
    Mutant(
        "beat-dispatch-any-caller",
        "BEAT_DISPATCH grants to a caller whose token no longer holds the lease, or whose "
        "fence is not the name's",
        (
            Edit("_scripts.py", "if redis.call('GET', KEYS[1]) ~= ARGV[1] or "
                 "redis.call('GET', KEYS[2]) ~= ARGV[2] then\n  return {0}",
                 "if false then\n  return {0}"),
        ),
    ),
    Mutant(
        "file-pointer-accepts-lower",
        "a FilePointer's swap accepts a fence below the one it accepted last",
        (
            Edit("store/_pointer.py", "                if fence < current[\"fence\"]:\n"
                 "                    raise _stale(",
                 "                if False:\n                    raise _stale("),
        ),
    ),
)  # fmt: skip


def apply(mutant: Mutant, into: Path) -> None:
    """Write ``mutant`` into a copy of the package under ``into``."""
    for edit in mutant.edits:
        path = into / edit.path
        text = path.read_text()
        found = text.count(edit.old)
        if found != edit.count:
            raise SystemExit(
                f"mutant {mutant.name}: {edit.path} holds {found} (not {edit.count}) of "
                f"{edit.old!r}: the code changed; update spec/mutants.py"
            )
        path.write_text(text.replace(edit.old, edit.new))


#: How the replay reports a step the code answered otherwise than the model (its own
#: AssertionError, raised with the trace's name and the step): only these catch a mutant.
STEP_FAILED = re.compile(r"AssertionError: \S+\.itf\.json, step \d+ \(\w+\): ")


@dataclass
class Outcome:
    """A replay's result: the traces run, the steps the code got wrong, other failures."""

    ran: int
    caught: list[str]
    broken: list[str]
    output: str


def replay(src: Path, every: bool = False) -> Outcome:
    """Run the replay against the package under ``src`` (until a trace fails, unless
    ``every``), and read each test's result from its JUnit XML report."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(ROOT / "tests")])}
    where = subprocess.run(
        [sys.executable, "-c", "import fenced; print(fenced.__file__)"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    if not where.startswith(str(src)):
        raise SystemExit(f"the replay would import fenced from {where}, not from {src}")
    report = src.parent / "replay.xml"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *([] if every else ["-x"]), "-p",
         "no:cacheprovider", "--tb=line", f"--junitxml={report}", REPLAY],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    text = out.stdout + out.stderr
    if not report.exists():
        return Outcome(0, [], [text[-2000:]], text)
    ran, caught, broken = 0, [], []
    for case in ElementTree.parse(report).iter("testcase"):
        if case.find("skipped") is not None:
            continue
        ran += 1
        for bad in [*case.iter("failure"), *case.iter("error")]:
            message = f"{bad.get('message', '')}\n{bad.text or ''}"
            found = STEP_FAILED.search(message)
            if bad.tag == "failure" and found:
                line = message[found.start() :].splitlines()[0]
                caught.append(line.removeprefix("AssertionError: ")[:220])
            else:
                broken.append(f"{case.get('name')}: {message.strip()[:300]}")
    return Outcome(ran, caught, broken, text)


def run_mutant(mutant: Mutant | None, every: bool = False) -> tuple[Outcome, float]:
    """Replay the traces on a copy of the package with ``mutant`` written into it (none:
    the copy as it is, which must pass)."""
    with tempfile.TemporaryDirectory(prefix="fenced-mutant-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(SRC, src / "fenced", ignore=shutil.ignore_patterns("__pycache__"))
        if mutant is not None:
            apply(mutant, src / "fenced")
        t0 = time.monotonic()
        outcome = replay(src, every)
    return outcome, time.monotonic() - t0


def main(argv: list[str]) -> int:
    every = "--every" in argv
    replayed = "--replayed" in argv
    argv = [a for a in argv if a not in ("--every", "--replayed")]
    chosen = [m for m in MUTANTS if not argv or any(m.name.startswith(a) for a in argv)]
    if not chosen:
        raise SystemExit(f"no mutant named {argv}: {', '.join(m.name for m in MUTANTS)}")
    if not any((ROOT / "spec" / "traces").glob("*.itf.json")):
        raise SystemExit("no traces in spec/traces: run spec/check.sh (make model) first")
    print(f"== {len(chosen)} mutants, each replayed on the model's traces until one fails")
    started = time.monotonic()
    # The copy as it is too (first in line), unless the replay just passed on the code:
    # every trace must pass on it, or a mutant's failures show nothing (the traces are
    # stale, or the replay is broken).
    with ThreadPoolExecutor(2) as pool:
        plain_run = None if replayed else pool.submit(run_mutant, None, True)
        results = list(pool.map(lambda m: run_mutant(m, every), chosen))
    if plain_run is not None:
        plain, _took = plain_run.result()
        if plain.caught or plain.broken or plain.ran == 0:
            print(plain.output[-3000:])
            raise SystemExit("the replay fails on the code as it is: run `make model` first")
        print(f"-- the code as it is: {plain.ran} traces replayed, none failed")
    survived = []
    for mutant, (outcome, took) in zip(chosen, results):
        if outcome.broken:
            print(outcome.output[-3000:])
            raise SystemExit(
                f"mutant {mutant.name}: the replay failed otherwise than on a step "
                f"({outcome.broken[0]}): the mutant breaks more than it names"
            )
        if outcome.ran == 0:
            print(outcome.output[-3000:])
            raise SystemExit(f"mutant {mutant.name}: the replay ran no trace")
        if outcome.caught and every:
            print(f"-- {mutant.name}: caught, {len(outcome.caught)} of {outcome.ran} traces "
                  f"failed ({took:.0f} s)")  # fmt: skip
        elif outcome.caught:
            print(f"-- {mutant.name}: caught, at trace {outcome.ran} of the replay ({took:.0f} s)")
        else:
            print(f"-- {mutant.name}: SURVIVED all {outcome.ran} traces ({took:.0f} s)")
            survived.append(mutant.name)
        print(f"   {mutant.what}")
        if outcome.caught:
            print(f"   first failure: {outcome.caught[0]}")
    print(f"(mutants: {time.monotonic() - started:.0f} s)")
    if survived:
        print(f"FAIL: the replay did not catch {', '.join(survived)}")
        return 1
    print(f"ok: {len(chosen)} of {len(chosen)} mutants caught")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
