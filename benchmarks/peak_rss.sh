#!/usr/bin/env bash
# The peak of the summed resident memory of a command and every process it starts (its session), e.g. the ranks of a
# DDP run; /usr/bin/time -v gives the largest single process only. Shared pages count once per process (an upper
# bound). Usage: bash benchmarks/peak_rss.sh CMD ARGS...  (prints "peak total RSS: N MiB" on stderr at the end)
setsid "$@" &
pid=$!
peak=0
while kill -0 "$pid" 2>/dev/null; do
  total=$(ps -o rss= -s "$pid" | awk '{s += $1} END {print s + 0}')
  [ "$total" -gt "$peak" ] && peak=$total
  sleep 0.1
done
wait "$pid"
status=$?
echo "peak total RSS: $((peak / 1024)) MiB" >&2
exit $status
