#!/bin/bash
# Session 26, call 8: call 7 again (1k, 14 rounds) with the clocks, power and throttle reasons logged.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 250 > $OUT/smi.csv &
SMI=$!
ROUNDS=14 timeout 500 python3 .dev/packed_step_ab.py 1024 2>&1 | grep -v Warn | tee $OUT/packed_step_ab_clocks.txt
kill $SMI
python3 - <<'PY'
import csv, os
rows = list(csv.reader(open(os.environ["OUT"] + "/smi.csv")))
print(rows[0])
for r in rows[1::8]:
    print(r)
PY
echo "done at $((SECONDS - S)) s"
