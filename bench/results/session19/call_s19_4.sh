#!/bin/bash
# Session 19, call 4: the scores kernel's epilogue cost, a TMA store, persistent programs.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
S=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
timeout 300 python3 .dev/scores_sweep.py > $OUT/scores_sweep.txt 2>&1; grep -v Warn $OUT/scores_sweep.txt | tail -45; echo "scores done at $((SECONDS - S)) s"
