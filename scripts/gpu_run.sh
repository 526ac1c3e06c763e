#!/usr/bin/env bash
# One GPU run: set up the GPU machine, run the GPU tests and the exllamav2 benchmark, summarize.
#
# Runs on a CUDA host with Python 3.12 and torch, which may be air-gapped, from the repository root.
# Needs the folders that scripts/wheelhouse.sh fills on a machine with PyPI access:
#   .whl/                      cp312 wheels of what the host lacks (exllamav2, pyzmq, quart, ...)
#   .gpu/exllamav2_ext.so.xz   exllamav2's extension prebuilt for the host's torch/CUDA (optional)
# Steps: install the wheels into /tmp/site (no index, no deps), put the extension and the repo on
# PYTHONPATH (JIT-building the extension if the prebuilt one does not import), write the demo
# models (tiny-gpu x2 and a Llama-3-8B shape) under /tmp/models, run `pytest -m gpu tests/gpu`
# and bench/bench_exllamav2.py, and print a short table last. Logs go to $OUT (default /tmp/gpu-out).
#
#   GPU_RUN_STAGES   which stages, in order (default "engine gateway bench"; also "bench-raw", "spec")
#   GPU_RUN_BUDGET_S wall-clock budget in seconds; stages are cut to fit (default 540)
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$PWD
export OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
stages=${GPU_RUN_STAGES:-engine gateway bench}
budget=${GPU_RUN_BUDGET_S:-540}
t0=$(date +%s)
exec > >(tee -a "$OUT/gpu_run.log") 2>&1

elapsed() { echo $(($(date +%s) - t0)); }
say() { echo "[gpu_run +$(elapsed)s] $*"; }
# Seconds a stage may take: its own cap, but never past the run's budget (with 25 s for the summary).
allow() { local left=$((budget - $(elapsed) - 25)); ((left < $1)) && echo "$left" || echo "$1"; }

declare -A status
say "host: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | paste -sd';')"

# ---- 1. wheels and extension ----------------------------------------------------------------------
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { say "wheel install failed"; exit 1; }
mkdir -p /tmp/ext
xz -dc .gpu/exllamav2_ext.so.xz >/tmp/ext/exllamav2_ext.so
export PYTHONPATH=/tmp/ext:/tmp/site:$repo${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if python3 -c "import torch, exllamav2_ext" 2>/tmp/ext_import.log; then
    status[extension]=prebuilt
else
    # A different torch on the host: exllamav2 builds its extension itself (~130 s on 16 cores).
    cat /tmp/ext_import.log
    say "the prebuilt extension does not import; exllamav2 will JIT-build it"
    rm -f /tmp/ext/exllamav2_ext.so
    export MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
    status[extension]=jit
fi
python3 -c "import exllamav2, exllamav2.ext, exllamav2.attn as a; print('exllamav2', exllamav2.__version__,
    'flash-attn paged:', a.has_flash_attn_with_paged)" || { say "exllamav2 does not import"; exit 1; }
say "setup done"

# ---- 2. models --------------------------------------------------------------------------------------
export GPU_TEST_TINY_MODEL=/tmp/models/tiny-gpu GPU_TEST_TINY_MODEL_B=/tmp/models/tiny-gpu-b
export GPU_TEST_BIG_MODEL=/tmp/models/llama3-8b GPU_TEST_RESULTS=$OUT/results.jsonl
python3 - <<'EOF' || { say "model creation failed"; exit 1; }
import os
from gateway.demo.model import make_demo_model
for env, preset, seed in (("GPU_TEST_TINY_MODEL", "tiny-gpu", 0), ("GPU_TEST_TINY_MODEL_B", "tiny-gpu", 1),
                          ("GPU_TEST_BIG_MODEL", "llama3-8b", 0)):
    make_demo_model(os.environ[env], preset=preset, seed=seed, device="cuda")
EOF
say "models written: $(du -sh /tmp/models | cut -f1)"

# ---- 3. stages ----------------------------------------------------------------------------------------
run_pytest() {  # name, test file, cap seconds
    local limit; limit=$(allow "$3")
    ((limit > 30)) || { status[$1]="skipped (out of time)"; return; }
    say "stage $1 (limit ${limit}s)"
    # -W default: exllamav2 and torch warnings are shown, not turned into errors (we cannot fix them).
    timeout -k 10 "$limit" python3 -m pytest -m gpu "$2" -p no:cacheprovider -W default -rA -v \
        --basetemp=/tmp/gpu-pytest-"$1" --junitxml="$OUT/junit-$1.xml" 2>&1 | tee "/tmp/pytest-$1.log"
    local rc=${PIPESTATUS[0]}
    status[$1]="rc=$rc $(grep -aEo '[0-9]+ (passed|failed|error|errors|skipped)' "/tmp/pytest-$1.log" | paste -sd' ')"
}
run_bench() {  # name, modes, cap seconds
    local limit; limit=$(allow "$3")
    ((limit > 60)) || { status[$1]="skipped (out of time)"; return; }
    say "stage $1 (limit ${limit}s)"
    timeout -k 10 "$limit" python3 bench/bench_exllamav2.py --model "$GPU_TEST_BIG_MODEL" --modes "$2" \
        --out-dir /tmp/bench
    status[$1]="rc=$?"
    cp /tmp/bench/bench_exllamav2.json /tmp/bench/bench_exllamav2.md "$OUT"/ 2>/dev/null
}
for stage in $stages; do
    case $stage in
        engine) run_pytest engine tests/gpu/test_engine_exllamav2.py 240 ;;
        gateway) run_pytest gateway tests/gpu/test_gateway_exllamav2.py 240 ;;
        bench) run_bench bench raw,gateway,two-gpus 240 ;;
        bench-raw) run_bench bench raw 150 ;;
        spec)  # speculative decoding: plain vs n-gram vs a draft model sharing the 8B shape's vocabulary
            limit=$(allow 200)
            say "stage spec (limit ${limit}s)"
            timeout -k 10 "$limit" python3 -c "from gateway.demo.model import make_demo_model as m; \
m('/tmp/models/draft-8b-vocab', preset='tiny-gpu', seed=3, device='cuda', vocab_size=128256)" &&
            timeout -k 10 "$limit" python3 bench/bench_speculative.py --model "$GPU_TEST_BIG_MODEL" \
                --draft /tmp/models/draft-8b-vocab --out "$OUT/bench_speculative.json" | tee "$OUT/bench_speculative.md"
            status[spec]="rc=${PIPESTATUS[0]}" ;;
        *) say "unknown stage $stage" ;;
    esac
done

# Gateway and worker logs of every test and benchmark, in one file (only 8 files come back).
for log in $(find /tmp/gpu-pytest-* /tmp/bench -name '*.log' 2>/dev/null | sort); do
    echo "===== $log"
    tail -c 20000 "$log"
done >"$OUT/service_logs.txt"

# ---- 4. summary, printed last ---------------------------------------------------------------------
say "done; stages: $(for k in "${!status[@]}"; do printf '%s=[%s] ' "$k" "${status[$k]}"; done)"
python3 - <<'EOF'
import json, os, pathlib
out = pathlib.Path(os.environ.get("OUT", "gpu-out"))
results = out / "results.jsonl"
if results.exists():
    print("\n| measurement | values |\n|---|---|")
    for line in results.read_text().splitlines():
        row = json.loads(line)
        values = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k != "test")
        print(f"| {row['test']} | {values} |")
bench = out / "bench_exllamav2.md"
if bench.exists():
    print()
    print(bench.read_text())
EOF
