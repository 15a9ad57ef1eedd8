#!/bin/bash
# The full run at HEAD (session 24): tests/gpu, the bench beside transformers with check_hf (1k/8k/32k), 128k alone,
# generation overhead (1k; chat), the profile.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
S=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu > $OUT/gpu_tests.txt 2>&1
tail -2 $OUT/gpu_tests.txt; echo "tests done at $((SECONDS - S)) s"
timeout 270 python3 -m diffgemma.cli bench --compare-hf --check-hf --init hf --contexts 1024,8192,32768 --out $OUT/h200.json > $OUT/h200_bench.txt 2>&1
grep -v Warn $OUT/h200_bench.txt | tail -22; echo "bench done at $((SECONDS - S)) s"
timeout 100 python3 -m diffgemma.cli bench --contexts 131072 --gen-steps 0 --out $OUT/h200_128k.json > $OUT/h200_128k_log.txt 2>&1; grep "diffgemma ctx" $OUT/h200_128k_log.txt; echo "128k done at $((SECONDS - S)) s"
timeout 45 python3 bench/generate_overhead.py --out $OUT/gen_1k.json 2>&1 | grep -v Warn | tail -2
timeout 45 python3 bench/generate_overhead.py --prompt 200 --f32-max 256 --out $OUT/gen_chat.json 2>&1 | grep -v Warn | tail -2
echo "gen done at $((SECONDS - S)) s"
timeout 40 python3 bench/profile_step.py > $OUT/h200_step_profile.txt 2>&1; grep "===\|kernels," $OUT/h200_step_profile.txt | cut -c1-160
echo "all done at $((SECONDS - S)) s"
