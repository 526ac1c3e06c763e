#!/usr/bin/env bash
# One GPU run: set up the CUDA host, run the GPU tests and the engine benchmarks, print a table last.
#
# Runs on a CUDA host with Python 3.12 and torch, which may be air-gapped, from the repository root.
# Needs the folders that scripts/wheelhouse.sh fills on a machine with PyPI access:
#   .whl/                       cp312 wheels of what the host lacks (exllamav2, exllamav3, pyzmq, quart, ...)
#   .gpu/exllamav2_ext.so.xz    exllamav2's extension prebuilt for the host's torch/CUDA (optional)
#   .gpu/exllamav3_ext.so.xz    exllamav3's extension, likewise (optional)
#   .gpu/flash_attn.tar.xz      a flash-attn build for the host (optional; without it exllamav2 runs unpaged)
# Steps: install the wheels into /tmp/site (no index, no deps), put the extensions, flash-attn and
# the repo on PYTHONPATH (an extension that does not import is JIT-built by its library instead),
# write the demo models (tiny-gpu x2 and a Llama-3-8B shape) under /tmp/models, run the stages,
# and print a short table last. Set-up and models are kept in /tmp between runs on the same host.
# Logs go to $OUT (default /tmp/gpu-out).
#
#   GPU_RUN_STAGES    stages, in order (default "tests bench-v2 bench-v3"); also "bench-v2-unpaged"
#                     (exllamav2 with paged: false, one stream), "two-gpus" (tests
#                     and benchmark that need two GPUs), "split" (exllamav3 by layers and tensor-parallel
#                     over two GPUs against one), "spec" (speculative decoding), "real-model"
#                     (train a small Llama here, convert it to EXL2 and EXL3, and test it against
#                     transformers: tests/gpu/test_real_model_gpu.py), "quant-bench" (see
#                     QUANT_PRESET), or a pytest path such as
#                     "tests/gpu/test_batching.py"
#   GPU_RUN_BUDGET_S  wall-clock budget in seconds; stages are cut to fit (default 540)
#   BENCH_ARGS        extra bench_engines.py arguments for bench-v2, bench-v2-unpaged and bench-v3 (e.g. "--streams 1,16,64
#                     --compare-threads --trace"); BENCH_CAP_S their time cap
#   TRAIN_SECONDS     real-model: how long the model trains (default 120)
#   QUANT_PRESET      quant-bench: the demo shape converted to 4 bpw EXL2 and EXL3 and benchmarked
#                     (default 1b; llama3-3b, the Llama 3.2 3B shape; llama3-8b where its conversions
#                     fit the run); QUANT_FORMATS (default exl2,exl3), QUANT_BENCH_ARGS for its benchmark
#   "logprobs-step"   what logprobs cost the engine's steps in-process (bench/bench_logprobs_step.py,
#                     LOGPROBS_BENCH_ARGS: say "--engine exllamav2 --baseline FILE"; BENCH_CAP_S its cap)
# A py-spy wheel in .tools/ (optional) makes the benchmarks profile one round of each path.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$PWD
export OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
stages=${GPU_RUN_STAGES:-tests bench-v2 bench-v3}
budget=${GPU_RUN_BUDGET_S:-540}
t0=$(date +%s)
exec > >(tee -a "$OUT/gpu_run.log") 2>&1

elapsed() { echo $(($(date +%s) - t0)); }
say() { echo "[gpu_run +$(elapsed)s] $*"; }
# Seconds a stage may take: its own cap, but never past the run's budget (with 20 s for the summary).
allow() { local left=$((budget - $(elapsed) - 20)); ((left < $1)) && echo "$left" || echo "$1"; }

declare -A status
say "host: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | paste -sd';')"

# ---- 1. wheels, extensions, flash-attn --------------------------------------------------------------
stamp="$(ls .whl .gpu .tools 2>/dev/null | md5sum | cut -c1-12)"
if [[ ! -f /tmp/site/.installed-$stamp ]]; then
    rm -rf /tmp/site /tmp/ext && mkdir -p /tmp/ext
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { say "wheel install failed"; exit 1; }
    for ext in exllamav2_ext exllamav3_ext; do
        [[ -f .gpu/$ext.so.xz ]] && xz -dc ".gpu/$ext.so.xz" >"/tmp/ext/$ext.so"
    done
    [[ -f .gpu/flash_attn.tar.xz ]] && xz -dc .gpu/flash_attn.tar.xz | tar x -C /tmp/ext
    if ls .tools/py_spy-*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/tools .tools/py_spy-*.whl
    fi
    touch "/tmp/site/.installed-$stamp"
    say "installed $(ls .whl | wc -l) wheels and $(ls /tmp/ext | paste -sd' ')"
fi
export PYTHONPATH=/tmp/ext:/tmp/site:$repo${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# A prebuilt extension made for another torch fails with "undefined symbol": the library builds its own.
export MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
for ext in exllamav2_ext exllamav3_ext; do
    if [[ -f /tmp/ext/$ext.so ]] && ! python3 -c "import torch, $ext" 2>"/tmp/$ext.log"; then
        cat "/tmp/$ext.log"
        say "the prebuilt $ext does not import; it will be JIT-built"
        rm -f "/tmp/ext/$ext.so"
    fi
    status[$ext]=$([[ -f /tmp/ext/$ext.so ]] && echo prebuilt || echo jit)
done
python3 -c "import exllamav2, exllamav2.ext, exllamav2.attn as a; print('exllamav2', exllamav2.__version__,
    'flash-attn paged:', a.has_flash_attn_with_paged)" || { say "exllamav2 does not import"; exit 1; }
python3 -c "import exllamav3; from exllamav3.version import __version__ as v; print('exllamav3', v)" ||
    { say "exllamav3 does not import"; exit 1; }
# The gateway and the worker must import here before any stage: a module missing from .whl/ fails now, once.
python3 -c "import gateway.server, model_worker.main" ||
    { say "the gateway or the worker does not import: add what is missing to scripts/wheelhouse.sh"; exit 1; }
say "setup done"

# ---- 2. models --------------------------------------------------------------------------------------
export GPU_TEST_TINY_MODEL=/tmp/models/tiny-gpu GPU_TEST_TINY_MODEL_B=/tmp/models/tiny-gpu-b
export GPU_TEST_BIG_MODEL=/tmp/models/llama3-8b GPU_TEST_RESULTS=$OUT/results.jsonl
export GPU_TEST_REQUIRE=exllamav2-paged,exllamav2-unpaged,exllamav3
# The 8B shape (16 GB, ~25 s to write) only for stages that use it: real-model and quant-bench make their own.
[[ -z $(printf '%s\n' $stages | grep -vxE 'real-model|quant-bench') ]] && export GPU_RUN_SKIP_BIG=1
python3 - <<'EOF' || { say "model creation failed"; exit 1; }
import os
from pathlib import Path
from gateway.demo.model import make_demo_model
for env, preset, seed in (("GPU_TEST_TINY_MODEL", "tiny-gpu", 0), ("GPU_TEST_TINY_MODEL_B", "tiny-gpu", 1),
                          ("GPU_TEST_BIG_MODEL", "llama3-8b", 0)):
    if env == "GPU_TEST_BIG_MODEL" and os.environ.get("GPU_RUN_SKIP_BIG"):
        continue
    if not (Path(os.environ[env]) / "config.json").exists():
        make_demo_model(os.environ[env], preset=preset, seed=seed, device="cuda")
EOF
say "models ready: $(du -sh /tmp/models | cut -f1)"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")

# ---- 3. stages ----------------------------------------------------------------------------------------
run_pytest() {  # name, cap seconds, pytest arguments...
    local name=$1 limit; limit=$(allow "$2"); shift 2
    ((limit > 30)) || { status[$name]="skipped (out of time)"; return; }
    say "stage $name (limit ${limit}s)"
    # -W default: library warnings are shown, not turned into errors (we cannot fix them).
    timeout -k 10 "$limit" python3 -m pytest -m gpu "$@" -p no:cacheprovider -W default -rfEs -v \
        --timeout 300 --basetemp="/tmp/gpu-pytest-$name" --junitxml="$OUT/junit-$name.xml" 2>&1 |
        tee "/tmp/pytest-$name.log"
    local rc=${PIPESTATUS[0]}
    status[$name]="rc=$rc $(grep -aEo '[0-9]+ (passed|failed|error|errors|skipped)' "/tmp/pytest-$name.log" | tail -4 | paste -sd' ')"
}
run_bench() {  # name, cap seconds, bench_engines.py arguments...
    local name=$1 limit; limit=$(allow "$2"); shift 2
    ((limit > 60)) || { status[$name]="skipped (out of time)"; return; }
    say "stage $name (limit ${limit}s)"
    local profile=()
    [[ -x /tmp/tools/bin/py-spy ]] && profile=(--py-spy /tmp/tools/bin/py-spy)
    timeout -k 10 "$limit" python3 bench/bench_engines.py --model "$GPU_TEST_BIG_MODEL" --out-dir /tmp/bench \
        "${profile[@]}" "$@"
    status[$name]="rc=$?"
}
# Train (or find from an earlier run on this host) a small real model, convert it to ~4 bpw EXL2 and
# EXL3 with the libraries' own converters, then test all of it through the gateway. Logs go where
# the run's summary files collect them (/tmp/bench: service_logs.txt, bench.json, bench.md).
real_model() {
    local trained=/tmp/models/trained-llama-34m quantized=/tmp/models/quantized limit
    mkdir -p /tmp/bench
    if [[ ! -f $trained/train_report.json ]]; then
        limit=$(allow $((${TRAIN_SECONDS:-120} + 90)))
        say "stage real-model: training for ${TRAIN_SECONDS:-120}s (limit ${limit}s)"
        timeout -k 10 "$limit" python3 scripts/train_small_llama.py "$trained" --seconds "${TRAIN_SECONDS:-120}" \
            2>&1 | tee /tmp/bench/real-model-train.log
        [[ -f $trained/train_report.json ]] || { status[real-model]="training failed"; return; }
    fi
    python3 -c "import json, sys; print(json.dumps({'test': 'trained model', **json.load(open(sys.argv[1]))}))" \
        "$trained/train_report.json" >>"$GPU_TEST_RESULTS"
    limit=$(allow 240)
    say "stage real-model: converting (limit ${limit}s)"
    timeout -k 10 "$limit" python3 scripts/convert_quantized.py "$trained" "$quantized" --bits 4.0 \
        --cal-length 1024 --report /tmp/bench/convert_quantized.json 2>&1 | tee /tmp/bench/real-model-convert.log
    python3 - "$GPU_TEST_RESULTS" <<'PY' || true
import json, sys
rows = json.load(open("/tmp/bench/convert_quantized.json"))
with open(sys.argv[1], "a") as out:
    for row in rows:
        out.write(json.dumps({"test": f"convert {row['format']}", **{k: v for k, v in row.items() if k != "folder"}}) + "\n")
PY
    export GPU_TEST_TRAINED_MODEL=$trained
    [[ -f $quantized/trained-llama-34m-exl2-4bpw/config.json ]] && export GPU_TEST_TRAINED_EXL2=$quantized/trained-llama-34m-exl2-4bpw
    [[ -f $quantized/trained-llama-34m-exl3-4bpw/config.json ]] && export GPU_TEST_TRAINED_EXL3=$quantized/trained-llama-34m-exl3-4bpw
    run_pytest real-model 300 tests/gpu/test_real_model_gpu.py
}
two_gpu_tests=(tests/gpu/test_mixed_registry.py tests/gpu/test_gateway_gpu.py::test_models_on_two_gpus_are_pinned
               tests/gpu/test_gateway_gpu.py::test_one_model_autosplit_over_two_gpus
               tests/gpu/test_gateway_gpu.py::test_exllamav3_over_two_gpus)
for stage in $stages; do
    case $stage in
        tests)  # on two GPUs the two-GPU tests are left to their own stage, in a fresh process
            deselect=()
            if ((gpus >= 2)); then
                for test in "${two_gpu_tests[@]}"; do [[ $test == *::* ]] && deselect+=(--deselect "$test"); done
            fi
            run_pytest tests 540 tests/gpu --ignore tests/gpu/test_mixed_registry.py \
                --ignore tests/gpu/test_real_model_gpu.py "${deselect[@]}" ;;
        real-model) real_model ;;
        quant-bench)  # QUANT_PRESET (default 1b; llama3-8b if its conversions fit a run) at 4 bpw, benchmarked
            preset=${QUANT_PRESET:-1b}
            qmodel=/tmp/models/$preset
            [[ -f $qmodel/config.json ]] || python3 -c "from gateway.demo.model import make_demo_model as m
m('$qmodel', preset='$preset', seed=0, device='cuda')"
            limit=$(allow 400)
            mkdir -p /tmp/bench
            say "stage quant-bench: converting $preset (limit ${limit}s)"
            # --resume: a conversion cut by the limit goes on in the next run on this host (8B: ~15 min of EXL3).
            timeout -k 10 "$limit" python3 scripts/convert_quantized.py "$qmodel" /tmp/models/quantized --bits 4.0 \
                --resume --formats "${QUANT_FORMATS:-exl2,exl3}" --report "/tmp/bench/convert_$preset.json" 2>&1 | tee "/tmp/bench/quant-convert-$preset.log"
            for fmt in exl2 exl3; do
                folder=/tmp/models/quantized/$preset-$fmt-4bpw
                engine=$([[ $fmt == exl2 ]] && echo exllamav2 || echo exllamav3)
                if [[ -f $folder/config.json ]]; then
                    run_bench "bench-$fmt" 200 --engine "$engine" --model "$folder" --paths raw,gateway \
                        ${QUANT_BENCH_ARGS:-}
                else
                    status[bench-$fmt]="skipped (no $fmt folder)"
                fi
            done ;;
        bench-v2) run_bench bench-v2 "${BENCH_CAP_S:-270}" --engine exllamav2 --paths raw,engine,gateway \
            ${BENCH_ARGS:-} ;;
        bench-v2-unpaged) run_bench bench-v2-unpaged "${BENCH_CAP_S:-150}" --engine exllamav2 --unpaged --streams 1 \
            --logprob-streams= --paths raw,engine,gateway ${BENCH_ARGS:-} ;;
        bench-v3) run_bench bench-v3 "${BENCH_CAP_S:-290}" --engine exllamav3 ${BENCH_ARGS:-} ;;
        logprobs-step)
            limit=$(allow "${BENCH_CAP_S:-290}")
            say "stage logprobs-step (limit ${limit}s)"
            timeout -k 10 "$limit" python3 bench/bench_logprobs_step.py --model "$GPU_TEST_BIG_MODEL" \
                --out-dir /tmp/bench ${LOGPROBS_BENCH_ARGS:-}
            status[logprobs-step]="rc=$?" ;;
        two-gpus)
            if ((gpus < 2)); then status[two-gpus]="skipped (one GPU)"; continue; fi
            run_pytest two-gpus 240 "${two_gpu_tests[@]}"
            run_bench bench-mixed 120 --skip-overhead --mixed-model "$GPU_TEST_BIG_MODEL" --new-tokens 128 ;;
        split)  # exllamav3 over two GPUs (layers, tensor-parallel) against one GPU, interleaved
            if ((gpus < 2)); then status[split]="skipped (one GPU)"; continue; fi
            run_bench bench-split "${BENCH_CAP_S:-200}" --engine exllamav3 --split --paths raw,gateway \
                --streams "${SPLIT_STREAMS:-1,64}" --new-tokens 128 --rounds 3 --logprob-streams= --cache-size 32768 ;;
        spec)  # speculative decoding: plain vs n-gram vs a draft model sharing the 8B shape's vocabulary
            limit=$(allow 200)
            say "stage spec (limit ${limit}s)"
            [[ -f /tmp/models/draft-8b-vocab/config.json ]] || python3 -c "from gateway.demo.model import \
make_demo_model as m; m('/tmp/models/draft-8b-vocab', preset='tiny-gpu', seed=3, device='cuda', vocab_size=128256)"
            for engine in exllamav2 exllamav3; do
                timeout -k 10 "$limit" python3 bench/bench_speculative.py --engine $engine --model "$GPU_TEST_BIG_MODEL" \
                    --draft /tmp/models/draft-8b-vocab --out "/tmp/bench/bench_speculative_$engine.json" |
                    tee -a /tmp/bench/bench_speculative.md
            done
            status[spec]="done" ;;
        tests/*) run_pytest "$(basename "${stage%%::*}" .py)" 420 "$stage" ;;
        *) say "unknown stage $stage" ;;
    esac
done

# Benchmark tables and JSON, and the gateway and worker logs in one file (only 8 files come back).
mkdir -p /tmp/bench
cat /tmp/bench/*.md >"$OUT/bench.md" 2>/dev/null
[[ -d /tmp/bench/profiles ]] && tar czf "$OUT/profiles.tar.gz" -C /tmp/bench profiles
python3 -c "import json, glob; print(json.dumps({f: json.load(open(f)) for f in sorted(glob.glob('/tmp/bench/*.json'))}))" \
    >"$OUT/bench.json" 2>/dev/null
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
bench = out / "bench.md"
if bench.exists():
    print()
    print(bench.read_text())
EOF
