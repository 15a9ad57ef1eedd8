#!/bin/bash
# Session 25, call 4: the dense MLP's side stream at a higher priority, in the step.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
timeout 400 python3 .dev/priority_ab.py $OUT/priority_ab.json 2>&1 | grep -v -i warn | tee $OUT/priority_ab.txt
echo "done at $((SECONDS - S)) s"
