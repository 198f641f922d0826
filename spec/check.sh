#!/usr/bin/env bash
# `make model`: simulate spec/fenced.qnt with Quint (the version package-lock.json pins,
# installed in spec/node_modules) on its TypeScript evaluator, then check that the
# simulator finds a counterexample to each limit the docs state.
#
#   MODEL_TRACES  traces of the main run, every fault the design answers for (10000)
#   MODEL_STEPS   steps in each of them (25)
#   MODEL_SEED    the first seed (each run adds its own offset); "random" for none
#   MODEL_JOBS    main-run processes side by side (2)
#   MODEL_REPLAY  traces written to spec/traces/ for tests/test_model_replay.py (200)
#   MODEL_REPLAY_WRITES  more of them, of holders paused past their lease (100)
#   MODEL_REPLAY_BEAT    more of them, of beat leaders (100)
set -euo pipefail
cd "$(dirname "$0")"

QUINT=node_modules/.bin/quint
TRACES=${MODEL_TRACES:-10000}
STEPS=${MODEL_STEPS:-25}
SEED=${MODEL_SEED:-5}
JOBS=${MODEL_JOBS:-2}
REPLAY=${MODEL_REPLAY:-200}
REPLAY_WRITES=${MODEL_REPLAY_WRITES:-100}
REPLAY_BEAT=${MODEL_REPLAY_BEAT:-100}
# The limits search longer traces: their counterexamples take a dozen chosen steps.
LIMIT_STEPS=60
LIMIT_SAMPLES=20000
INVARIANTS=(storeMonotone writesByGrantees releaseOwnOnly fencesIncrease exclusive pointerWithReplicas beatGrantedOnce releaseAnswerKept)
WITNESSES=(staleWriteRefused twoHolders grantAfterForgetting threeGrants twoTicksSent takenOverTickSent)

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
started=$SECONDS

seed_for() {  # seed_for OFFSET: the --seed option of one run
    if [ "$SEED" = random ]; then return; fi
    echo "--seed=$((SEED + $1))"
}

quint_run() {  # quint_run FILE ARGS...: one simulation, its output in FILE
    local file=$1
    shift
    # `--invariants` reads every later word as a name: the spec comes first.
    "$QUINT" run fenced.qnt --backend typescript "$@" >"$file" 2>&1
}

echo "== the model: spec/fenced.qnt, Quint $("$QUINT" --version), TypeScript evaluator"

# -- the main run: every invariant, under every fault the design answers for -------
per=$(((TRACES + JOBS - 1) / JOBS))
echo "== $((per * JOBS)) traces of $STEPS steps ($JOBS runs of $per), every invariant checked at every step"
pids=()
for j in $(seq 1 "$JOBS"); do
    # shellcheck disable=SC2046
    quint_run "$out/main$j" --max-samples "$per" --max-steps "$STEPS" $(seed_for "$j") \
        --mbt --out-itf "$out/main$j.itf.json" --verbosity 1 \
        --invariants "${INVARIANTS[@]}" --witnesses "${WITNESSES[@]}" &
    pids+=($!)
done
failed=0
for j in $(seq 1 "$JOBS"); do
    if ! wait "${pids[$((j - 1))]}"; then failed=1; fi
done
total=0
declare -A seen=()
for j in $(seq 1 "$JOBS"); do
    if grep -q '^\[ok\]' "$out/main$j"; then
        total=$((total + per))
        while read -r name _was _witnessed _in n _rest; do
            seen[$name]=$((${seen[$name]:-0} + n))
        done < <(grep ' was witnessed in ' "$out/main$j")
    else
        failed=1
        echo "-- run $j: an invariant broke"
        cat "$out/main$j"
        if [ -s "$out/main$j.itf.json" ]; then python3 show.py "$out/main$j.itf.json"; fi
    fi
done
if [ "$failed" != 0 ]; then
    echo "FAIL: an invariant of the design broke (the counterexample is above)"
    exit 1
fi
echo "ok: $total traces simulated in $((SECONDS - started)) s, no invariant broke: ${INVARIANTS[*]}"
for name in "${WITNESSES[@]}"; do
    echo "   $name: reached in ${seen[$name]:-0} of $total traces"
done

# -- the stated limits: each a counterexample the simulator must find ---------------
# initial state (the faults allowed) | the invariant that must break | the limit
LIMITS=(
    "initRestart|oneHolder|a restart of Redis without persistence forgets the lease: two holders at once"
    "initFailover|oneHolder|a failover without replicas forgets a lease: two holders at once"
    "initFailoverPointer|pointerMonotone|a failover without replicas forgets a swap reported done: the RedisPointer accepts a lower fence"
    "initFailoverReplicas|pointerMonotoneAll|with replicas, a swap that raised \"not durable\" and is lost in a failover lets the pointer accept a lower fence again"
    "initOperator|oneHolder|an operator's release (fenced release) ends a live holder's lease: two holders at once"
    "initDrift|oneHolder|a holder whose clock drifts more than the margin trusts a lease Redis already ended: two holders at once"
    "initClockBack|fencesIncrease|a server clock that steps back, then a restart: a fence granted again (the clock-moves-forward assumption)"
    "initFailoverClockBack|fencesIncrease|a failover to a master whose clock is behind the old one's by more than the failover took, without replicas: a fence granted again"
    "initBeatPause|tickSentOnce|a beat leader paused between its last check and its send, past its lease: the next leader sends the same tick too"
    "initBeatRestart|beatGrantedOnceEver|a restart without persistence forgets the beat's due times: one is granted again"
)
echo "== ${#LIMITS[@]} stated limits: each must give a counterexample (traces of up to $LIMIT_STEPS steps)"
run_limit() {  # run_limit INDEX: one limit's search, its output in $out/limitINDEX
    local init inv
    IFS='|' read -r init inv _ <<<"${LIMITS[$1]}"
    # shellcheck disable=SC2046
    quint_run "$out/limit$1" --init "$init" --invariant "$inv" --max-samples "$LIMIT_SAMPLES" \
        --max-steps "$LIMIT_STEPS" $(seed_for $((100 + $1))) --mbt --out-itf "$out/limit$1.itf.json" \
        --verbosity 1 || true
}
i=0
while [ $i -lt ${#LIMITS[@]} ]; do
    pids=()
    for k in $(seq $i $((i + JOBS - 1))); do
        if [ "$k" -lt ${#LIMITS[@]} ]; then
            run_limit "$k" &
            pids+=($!)
        fi
    done
    wait "${pids[@]}"
    i=$((i + JOBS))
done
missed=0
for k in "${!LIMITS[@]}"; do
    IFS='|' read -r init inv what <<<"${LIMITS[$k]}"
    echo
    echo "-- limit $((k + 1)): $what"
    echo "   (--init $init, invariant $inv expected to break)"
    if grep -q '^\[violation\]' "$out/limit$k"; then
        # The counterexample, one line a state (spec/show.py says how to read it).
        python3 show.py "$out/limit$k.itf.json" | sed 's/^/   /'
    else
        missed=1
        echo "   NOT FOUND: the simulator found no counterexample"
        sed 's/^/   /' "$out/limit$k"
    fi
done
echo
echo "(the limits searched by $((SECONDS - started)) s)"
if [ "$missed" != 0 ]; then
    echo "FAIL: a stated limit gave no counterexample"
    exit 1
fi

# -- traces for the replay on the real scripts (tests/test_model_replay.py) ---------
rm -rf traces
mkdir traces
# shellcheck disable=SC2046
if ! quint_run "$out/replay" --init initReplay --invariants "${INVARIANTS[@]}" \
    --max-samples "$REPLAY" --n-traces "$REPLAY" --max-steps 40 $(seed_for 200) \
    --mbt --out-itf 'traces/trace{seq}.itf.json' --verbosity 1; then
    cat "$out/replay"
    echo "FAIL: an invariant broke in the replay configuration"
    exit 1
fi
# A second set: holders paused past their lease, their writes landing late (stale
# writes refused by the stores are common in it, rare in the first set).
# shellcheck disable=SC2046
if ! quint_run "$out/writes" --init initReplayWrites --step stepWrites \
    --invariants "${INVARIANTS[@]}" --max-samples "$REPLAY_WRITES" --n-traces "$REPLAY_WRITES" \
    --max-steps 80 $(seed_for 300) --mbt --out-itf 'traces/writes{seq}.itf.json' --verbosity 1; then
    cat "$out/writes"
    echo "FAIL: an invariant broke in the replay's writes configuration"
    exit 1
fi
# A third: beat leaders dispatching, sending, taking over each other's ticks, restarts.
# shellcheck disable=SC2046
if ! quint_run "$out/beat" --init initReplayBeat --step stepBeat \
    --invariants "${INVARIANTS[@]}" --witnesses takenOverTickSent \
    --max-samples "$REPLAY_BEAT" --n-traces "$REPLAY_BEAT" \
    --max-steps 60 $(seed_for 400) --mbt --out-itf 'traces/beat{seq}.itf.json' --verbosity 1; then
    cat "$out/beat"
    echo "FAIL: an invariant broke in the replay's beat configuration"
    exit 1
fi
# The take-over path (a successor sends its predecessor's tick, BEAT_SENT marks it) must
# be among the replayed traces, or the replay does not exercise it.
taken=$(sed -n 's/^takenOverTickSent was witnessed in \([0-9]*\) .*/\1/p' "$out/beat")
if [ "${taken:-0}" -lt 1 ]; then
    cat "$out/beat"
    echo "FAIL: no beat trace sends a tick a predecessor was granted (takenOverTickSent)"
    exit 1
fi
echo "== $(find traces -name 'trace*.itf.json' | wc -l) traces of up to 40 steps, $(find traces -name 'writes*.itf.json' | wc -l) of up to 80 (late writes) and $(find traces -name 'beat*.itf.json' | wc -l) of up to 60 (the beat) written to spec/traces/ for the replay ($((SECONDS - started)) s so far)"
echo "ok: $total traces with every invariant holding; ${#LIMITS[@]} of ${#LIMITS[@]} stated limits found; $((SECONDS - started)) s"
