#!/usr/bin/env bash
# Issue 25's in-process hand-off (actors/local.py), before (.carry/old: a24d59b, then 3f2c8b5,
# the tree before issue 25) and after (.carry/new): the 1B shape's decode at batch 1 and 64,
# old/new alternating, N pairs (default 4), unpinned; then (SPY=1, the default) py-spy over the
# new tree's batch-64 decode. session8_ab.sh does the work. `.whl`, `.carry/old` and `.carry/new`
# carried; one GPU, no model. Run from the repository root.
PINS=0 SPY=${SPY:-1} exec bash tests/perf/session8_ab.sh "${1:-4}"
