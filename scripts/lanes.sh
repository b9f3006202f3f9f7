#!/usr/bin/env bash
# The whole suite as two pytest sessions side by side ("lanes"), then the two-node tests at the
# end of whichever lane finishes first (scripts/test.sh runs this after lint). A test's cost is
# mostly start-ups (Ray, a vLLM engine, a trainer: one process importing on one core while the
# other idles), so two lanes overlap them. tests.support.lanes splits the test files by their
# measured seconds (tests/lanes.json); every file is in exactly one lane.
#
# Output: lane a streams here; lane b writes to a log, shown after lane a's output (complete,
# then live until lane b ends), each with its --durations table; the last line gives each
# lane's exit status. Exit status: 0 only if both lanes passed; 1 where a lane collected no
# test (a broken suite, not a pass).
#
# Trying a split: LANE_A="files..." LANE_B="files..." LANE_B_TAIL="" bash scripts/lanes.sh
# (LANE_B_TAIL: what the first lane to finish runs last, in a fresh process; default
# tests/multinode. The split counts it in lane b's work, so lane b normally finishes first and
# runs it; where the measured seconds were off and lane a is done first, lane a runs it and
# lane b's longer tail no longer adds the two-node tests' minutes on top.)
set -uo pipefail
cd "$(dirname "$0")/.."
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
PY=.venv/bin/python

# Each lane runs in a private mount namespace with its own /dev/shm (as large as the host's):
# weight files (/dev/shm/asyncrl-RUN-vN.safetensors, and two lanes may run jobs of one run
# name), vLLM's and Ray's segments, and the tests that list /dev/shm for leftovers see their
# own lane's only. /tmp stays shared: the code sandbox's slot locks there are host-wide on
# purpose (tests.support.lanes keeps the sandbox's tests in one lane).
SHM_KB="$(df -k --output=size /dev/shm 2>/dev/null | tail -n 1 | tr -d ' ')"
isolated() {
    unshare --mount --propagation private sh -c \
        'mount -t tmpfs -o "size=${0}k,mode=1777" tmpfs /dev/shm && exec "$@"' "$SHM_KB" "$@"
}
can_isolate() {
    [ -n "$SHM_KB" ] && command -v unshare >/dev/null 2>&1 && isolated true 2>/dev/null
}
# pytest exits 5 when it collected no test: that is a broken suite here, not a pass.
checked() {
    if [ "$2" = 5 ]; then echo "[test] $1: pytest collected no tests"; return 1; fi
    return "$2"
}

if [ -n "${LANE_A+x}" ] || [ -n "${LANE_B+x}" ]; then
    read -r -a A <<<"${LANE_A:-}"
    read -r -a B <<<"${LANE_B:-}"
else
    mapfile -t A < <($PY -m tests.support.lanes a)
    mapfile -t B < <($PY -m tests.support.lanes b)
fi
read -r -a TAIL <<<"${LANE_B_TAIL-tests/multinode}"
if [ "${#A[@]}" = 0 ] || [ "${#B[@]}" = 0 ]; then
    echo "[test] a lane has no test files (python -m tests.support.lanes a|b): a broken split"
    exit 1
fi

CLAIM="$(mktemp -u "${TMPDIR:-/tmp}/asyncrl-lane-tail.XXXXXX")"
tail_of() { # $1: the lane, $2: the wrapper (isolated) or nothing. Runs the tail in this lane if
    # no other lane took it first (mkdir is atomic: one lane gets it).
    [ "${#TAIL[@]}" = 0 ] && return 0
    mkdir "$CLAIM" 2>/dev/null || return 0
    echo "[test] lane $1 runs ${TAIL[*]}"
    # A fresh driver process: one that already ran (and shut down) the session's local Ray
    # mis-scheduled actors on the two-node cluster, as no real driver would.
    $2 $PY -m pytest --durations=5 "${TAIL[@]}"
    checked "lane $1: ${TAIL[*]}" $?
}

lane() { # $1: the lane (a or b), $2: the wrapper (isolated) or nothing
    local files
    if [ "$1" = a ]; then files=("${A[@]}"); else files=("${B[@]}"); fi
    $2 $PY -m pytest --durations=20 "${files[@]}"
    # A failed lane leaves the tail to the other one (the run fails either way).
    checked "lane $1" $? || return $?
    tail_of "$1" "$2"
}

start=$SECONDS
if can_isolate; then
    B_LOG="$(mktemp --suffix=.log "${TMPDIR:-/tmp}/asyncrl-lane-b.XXXXXX")"
    echo "[test] two lanes side by side: a (${#A[@]} files, below) and b (${#B[@]} files, then" \
        "${TAIL[*]:-nothing}; its log $B_LOG follows lane a's output)"
    # ASYNCRL_TEST_LANE: set while another lane runs beside this one (a test that would run
    # several engines of its own at a time runs them one after another then).
    set -m # lane b in a process group of its own: stopped with this script
    (export ASYNCRL_TEST_LANE=b && lane b isolated) >"$B_LOG" 2>&1 &
    b_pid=$!
    set +m
    trap 'kill -TERM -- -"$b_pid" 2>/dev/null; rmdir "$CLAIM" 2>/dev/null' EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    echo "===== lane a"
    (export ASYNCRL_TEST_LANE=a && lane a isolated)
    rc_a=$?
    echo "[test] lane a: exit $rc_a after $((SECONDS - start)) s"
    echo "===== lane b ($B_LOG)"
    tail -n +1 -f --pid="$b_pid" "$B_LOG"
    wait "$b_pid"
    rc_b=$?
    trap - EXIT
    rmdir "$CLAIM" 2>/dev/null
else
    # Without a private /dev/shm each, two lanes would see each other's files there.
    echo "[test] unshare --mount is refused here (it needs root): the lanes run one after the other"
    echo "===== lane a"
    $PY -m pytest --durations=20 "${A[@]}"
    checked "lane a" $?
    rc_a=$?
    echo "===== lane b"
    lane b ""
    rc_b=$?
    rmdir "$CLAIM" 2>/dev/null
fi
echo "[test] lane a: exit $rc_a; lane b: exit $rc_b${TAIL[*]:+ (${TAIL[*]} in the lane that finished first)}; both after $((SECONDS - start)) s"
[ "$rc_a" = 0 ] || exit "$rc_a"
exit "$rc_b"
