#!/bin/bash
# The chat-turn ids of bench/generate_overhead.py (prompt 200, fp32 prefill) under each expert config, 2 runs each.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
for cfg in m32_s2_tma m32_s2_tma_cf m32_s2_tma_swap; do
  timeout 60 python3 -c "
import runpy, sys
import diffgemma.kernels.triton_moe as tm
tm.DEFAULT_CONFIG = '$cfg'
sys.modules['__main__'].__dict__
import importlib.util
spec = importlib.util.spec_from_file_location('go', 'bench/generate_overhead.py')
go = importlib.util.module_from_spec(spec); spec.loader.exec_module(go)
go.RUNS = 2
sys.argv = ['go', '--prompt', '200', '--f32-max', '256']
go.main()
" 2>&1 | grep -v Warn | grep "ids" | sed "s/^/$cfg: /"
done
