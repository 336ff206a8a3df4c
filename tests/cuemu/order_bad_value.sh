#!/bin/sh
# ctest cuemu/order_bad_value: a misspelt TITAN_CUEMU_ORDER stops the first
# kernel launch with one line and exit 2, never a silent forward-order run.
# $1: the titan_cuemu binary.
out=$(TITAN_CUEMU=1 TITAN_CUEMU_ORDER=sideways "$1" -e \
  'local t = require("titan"); print((t.ones(4):to("cuda:0") * 2):to("cpu"))' 2>&1)
rc=$?
want="cuemu: TITAN_CUEMU_ORDER=sideways (expected forward or reverse)"
if [ "$rc" = 2 ] && [ "$out" = "$want" ]; then exit 0; fi
echo "expected exit 2 and: $want"
echo "got exit $rc and: $out"
exit 1
