#!/usr/bin/env bash
# The whole suite as two pytest sessions side by side ("lanes"), then the two-node tests after
# lane b (scripts/test.sh runs this after lint). A test's cost is mostly start-ups (Ray, a vLLM
# engine, a trainer: one process importing on one core while the other idles), so two lanes
# overlap them. tests.support.lanes splits the test files by their measured seconds
# (tests/lanes.json); every file is in exactly one lane.
#
# Output: lane a streams here; lane b writes to a log, shown after lane a's output (complete,
# then live until lane b ends), each with its --durations table; the last line gives each
# lane's exit status. Exit status: 0 only if both lanes passed; 1 where a lane collected no
# test (a broken suite, not a pass).
#
# Trying a split: LANE_A="files..." LANE_B="files..." LANE_B_TAIL="" bash scripts/lanes.sh
# (LANE_B_TAIL: what lane b runs last, in a fresh process; default tests/multinode).
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

lane_b() { # $1: the wrapper (isolated) or nothing
    $1 $PY -m pytest --durations=20 "${B[@]}"
    checked "lane b" $? || return $?
    [ "${#TAIL[@]}" = 0 ] && return 0
    # A fresh driver process: one that already ran (and shut down) the session's local Ray
    # mis-scheduled actors on the two-node cluster, as no real driver would.
    $1 $PY -m pytest --durations=5 "${TAIL[@]}"
    checked "lane b: ${TAIL[*]}" $?
}

start=$SECONDS
if can_isolate; then
    B_LOG="$(mktemp --suffix=.log "${TMPDIR:-/tmp}/asyncrl-lane-b.XXXXXX")"
    echo "[test] two lanes side by side: a (${#A[@]} files, below) and b (${#B[@]} files, then" \
        "${TAIL[*]:-nothing}; its log $B_LOG follows lane a's output)"
    # ASYNCRL_TEST_LANE: set while another lane runs beside this one (a test that would run
    # several engines of its own at a time runs them one after another then).
    set -m # lane b in a process group of its own: stopped with this script
    (export ASYNCRL_TEST_LANE=b && lane_b isolated) >"$B_LOG" 2>&1 &
    b_pid=$!
    set +m
    trap 'kill -TERM -- -"$b_pid" 2>/dev/null' EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    echo "===== lane a"
    ASYNCRL_TEST_LANE=a isolated $PY -m pytest --durations=20 "${A[@]}"
    checked "lane a" $?
    rc_a=$?
    echo "[test] lane a: exit $rc_a after $((SECONDS - start)) s"
    echo "===== lane b ($B_LOG)"
    tail -n +1 -f --pid="$b_pid" "$B_LOG"
    wait "$b_pid"
    rc_b=$?
    trap - EXIT
else
    # Without a private /dev/shm each, two lanes would see each other's files there.
    echo "[test] unshare --mount is refused here (it needs root): the lanes run one after the other"
    echo "===== lane a"
    $PY -m pytest --durations=20 "${A[@]}"
    checked "lane a" $?
    rc_a=$?
    echo "===== lane b"
    lane_b ""
    rc_b=$?
fi
echo "[test] lane a: exit $rc_a; lane b${TAIL[*]:+ (then ${TAIL[*]})}: exit $rc_b; both after $((SECONDS - start)) s"
[ "$rc_a" = 0 ] || exit "$rc_a"
exit "$rc_b"
