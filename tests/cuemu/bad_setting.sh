#!/bin/sh
# ctest cuemu/bad_setting: a misspelt TITAN_CUEMU_ORDER or TITAN_CUEMU_STREAMS
# stops the first kernel launch with one line and exit 2, never a silent run
# in the default mode. $1: the titan_cuemu binary.
status=0
check() { # VARIABLE VALUE EXPECTED-LINE
  out=$(env TITAN_CUEMU=1 "$1=$2" "$bin" -e \
    'local t = require("titan"); print((t.ones(4):to("cuda:0") * 2):to("cpu"))' 2>&1)
  rc=$?
  if [ "$rc" = 2 ] && [ "$out" = "$3" ]; then return; fi
  echo "$1=$2: expected exit 2 and: $3"
  echo "got exit $rc and: $out"
  status=1
}
bin=$1
check TITAN_CUEMU_ORDER sideways "cuemu: TITAN_CUEMU_ORDER=sideways (expected forward or reverse)"
check TITAN_CUEMU_STREAMS lazy "cuemu: TITAN_CUEMU_STREAMS=lazy (expected inline or deferred)"
exit $status
