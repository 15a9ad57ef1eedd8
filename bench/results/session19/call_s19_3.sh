#!/bin/bash
# Session 19, call 3: the full layers' scores with tile stats (a one-read softmax) against the path in use;
# gate_up with 16 pairs a tile and 512-byte weight rows.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
S=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
timeout 240 python3 .dev/scores_sweep.py > $OUT/scores_sweep.txt 2>&1; grep -v Warn $OUT/scores_sweep.txt | tail -40; echo "scores done at $((SECONDS - S)) s"
timeout 150 python3 .dev/persist_ab.py call3 > $OUT/gate_up_m16.txt 2>&1; grep -v Warn $OUT/gate_up_m16.txt | tail -40; echo "all done at $((SECONDS - S)) s"
