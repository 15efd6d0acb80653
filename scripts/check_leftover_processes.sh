#!/usr/bin/env bash
# Fails when processes of session SID are still alive: what a test run left behind (a test's
# child that outlived its parent is re-parented, but keeps its session). Lists them, ends them
# (by pid: TERM, then KILL), exits 1; exits 0 when the session is empty. Waits up to
# WAIT_S seconds (default 10) for processes that are already on their way out.
#   scripts/check_leftover_processes.sh SID
set -uo pipefail
sid=${1:?usage: $0 SESSION_ID}
wait_s=${WAIT_S:-10}
leftovers() { ps -o pid= -s "$sid" 2>/dev/null | tr -d ' ' | grep -v '^$'; }
for (( i = 0; i < wait_s * 2; i++ )); do
  [ -z "$(leftovers)" ] && exit 0
  sleep 0.5
done
pids=$(leftovers)
[ -z "$pids" ] && exit 0
echo "error: the test run left $(echo "$pids" | wc -l) process(es) behind (session $sid):" >&2
ps -o pid=,ppid=,etime=,rss=,args= -p "$(echo $pids | tr ' ' ',')" | sed 's/^/  /' | cut -c1-240 >&2
echo "ending them; a test that starts processes must end them (tests/megatron/megatron_utils.py:end_child_processes)" >&2
for pid in $pids; do kill -TERM "$pid" 2>/dev/null; done
sleep 2
for pid in $(leftovers); do kill -KILL "$pid" 2>/dev/null; done
exit 1
