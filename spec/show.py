"""Print a trace of spec/fenced.qnt (an ITF file written with --mbt) one line a state.

    python3 spec/show.py TRACE.itf.json

Each line: the step taken and what it picked, the time, what the master and the replica
hold (lease token and expiry, fence, pointer, the beat's due time), each process (the
token it believes it holds, its fence, its local deadline, a write in flight, a beat
tick in hand) and the store outside Redis.
Standard library only: `make model` runs it without the project's environment.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def plain(value: Any) -> Any:
    """An ITF value as plain Python: ints, lists, dicts, sets as sorted lists."""
    if isinstance(value, dict):
        if "#bigint" in value:
            return int(value["#bigint"])
        if "#map" in value:
            return {plain(k): plain(v) for k, v in value["#map"]}
        if "#set" in value:
            return sorted(plain(v) for v in value["#set"])
        if "#tup" in value:
            return [plain(v) for v in value["#tup"]]
        return {k: plain(v) for k, v in value.items() if k != "#meta"}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def states(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The states of an ITF trace, as plain Python."""
    with open(path) as f:
        return [plain(s) for s in json.load(f)["states"]]


def picks(state: dict[str, Any]) -> dict[str, Any]:
    """The nondeterministic choices the step into this state made."""
    chosen = state.get("mbt::nondetPicks", {})
    return {k: v["value"] for k, v in chosen.items() if v.get("tag") == "Some"}


def keys(k: dict[str, Any], now: int) -> str:
    lease = (
        f"lease {k['lease']} until {k['expires']}" if k["lease"] and now < k["expires"] else "free"
    )
    ptr = f"ptr {k['ptrFence']} by {k['ptrToken']}" if k["ptrToken"] else "ptr -"
    beat = f", beat {k['beatDue']}@{k['beatFence']} {k['beatState']}" if k["beatState"] else ""
    return f"[{lease}, fence {k['fence'] or '-'}, {ptr}{beat}]"


def proc(name: str, p: dict[str, Any], now: int) -> str:
    if p["token"]:
        trusts = "holds" if now < p["deadline"] else "expired"
        text = f"{name} {trusts} {p['token']}@{p['fence']} to {p['deadline']}"
    else:
        text = f"{name} -"
    w = p["pending"]
    if w["token"]:
        text += f" writing {w['dest']} {w['token']}@{w['fence']}"
    if p["retry"]:
        text += f" re-releasing {p['retry']}"
    t = p["tick"]
    if t["due"]:
        text += f" tick {t['due']}@{t['fence']}" + (" checked" if t["checked"] else "")
    return text


STEP_PICKS = {
    "acquire": ("p", "err", "acked"),
    "renew": ("p", "err", "acked"),
    "expireLocally": ("p",),
    "startWrite": ("p", "dest"),
    "tick": ("d",),
    "landWrite": ("p", "acked"),
    "release": ("p", "acked", "lost"),
    "releaseRetry": ("p",),
    "crash": ("p",),
    "dispatch": ("p", "back"),
    "takeOver": ("p",),
    "checkTick": ("p",),
    "sendTick": ("p",),
}


def line(i: int, s: dict[str, Any]) -> str:
    action = s.get("mbt::actionTaken", "?")
    chosen = picks(s)
    args = " ".join(f"{k}={chosen[k]}" for k in STEP_PICKS.get(action, ()) if k in chosen)
    now = s["now"]
    procs = "; ".join(proc(n, p, now) for n, p in sorted(s["procs"].items()))
    store = f"{s['store']['fence']} by {s['store']['token']}" if s["store"]["token"] else "-"
    return (
        f"{i:>2} {action} {args}".ljust(34)
        + f" t={now} master{keys(s['master'], now)} replica{keys(s['replica'], now)}"
        + f" | {procs} | store {store}"
    )


def main(argv: list[str]) -> int:
    for path in argv:
        trace = states(path)
        for i, s in enumerate(trace):
            print(line(i, s))
        last = trace[-1]
        grants = " ".join(f"{g['token']}@{g['fence']}" for g in last["grants"])
        print(f"   grants (token@fence): {grants}")
        print(f"   pointer accepted: {' '.join(_accepted(a) for a in last['ptrLog']) or '-'}")
        print(f"   store accepted:   {' '.join(_accepted(a) for a in last['storeLog']) or '-'}")
        beat = last["beatLog"]
        if beat["ever"]:
            print(
                f"   beat: due times granted {' '.join(map(str, beat['ever']))}; ticks sent "
                + (" ".join(f"{x['due']} by {x['token']}" for x in beat["sends"]) or "-")
            )
    return 0


def _accepted(a: dict[str, Any]) -> str:
    return f"{a['token']}@{a['fence']}" + ("" if a["confirmed"] else "(not durable)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
