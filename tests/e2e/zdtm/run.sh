# shellcheck shell=sh
# The workload of a zdtm pod: /zdtm/subreaper /bin/sh /zdtm/run.sh TEST...
# Starts each zdtm test in its own directory /zdtm/TEST, as CRIU's zdtm Makefile does
# (./TEST --pidfile=TEST.pid --outfile=TEST.out plus the options in /zdtm/TEST/args). A test's
# first process returns once the test is ready (test_daemon()); the test itself runs on, an
# orphan kept in this tree by the subreaper; a start that takes over 20 s is killed (its rc is 137). Then the pod says it is ready for a checkpoint and
# waits. Each test's exit status of its start is in /zdtm/TEST/start.rc, its PASS or FAIL in
# /zdtm/TEST/TEST.out once it got SIGTERM.
trap 'exit 0' TERM INT
for t in "$@"; do
    cd "/zdtm/$t" || exit 1
    # shellcheck disable=SC2046 # the options are words
    timeout -s KILL 20 "./$t" --pidfile="$t.pid" --outfile="$t.out" $(cat args) 2>start.err
    echo $? >start.rc
done
cd /
if [ -n "$REKINDLE_CONTROL_DIR" ]; then
    touch "$REKINDLE_CONTROL_DIR/ready-for-checkpoint"
fi
touch /zdtm/started
while :; do
    sleep 3600 &
    wait $!
done
