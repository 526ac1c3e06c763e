#!/usr/bin/env bash
# Build the wheelhouse for an air-gapped CUDA host.
#
# Runs on a machine that can reach PyPI (a developer box or CI), never on the GPU host itself.
# It downloads cp312 manylinux x86_64 wheels of everything this project needs at run time that a
# typical CUDA image (Python 3.12 with torch, transformers, tokenizers, safetensors, msgpack,
# pyyaml, jinja2, httpx, prometheus-client and pytest) lacks, into ./.whl/ (git-ignored). Copy
# .whl/ to the host and install it there without an index:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PYTHONPATH
#
# Every package is fetched with --no-deps and an exact version: a resolver run for the target
# platform would drag in torch (exllamav2 requires it), gigabytes the host already has. So the
# dependency closure is spelled out below; when a version changes, list its new Requires-Dist with
# `unzip -p .whl/NAME-*.whl '*/METADATA' | grep ^Requires-Dist`. exllamav2's own extras
# (fastparquet, websockets) are only used by its converter and its websocket demo server, which
# this project never imports. exllamav3 also needs rich, pillow and ninja, which CUDA images with
# torch usually have; add them below if yours does not.
#
# Usage: scripts/wheelhouse.sh [DEST]      (DEST defaults to .whl in the repository root)
# Environment:
#   PREBUILT_DIR   a folder of CUDA builds made once for the host's torch/CUDA (exllamav2_ext-*.so.xz,
#                  exllamav3_ext-*.so.xz, flash_attn-*.tar.xz): copied into .gpu/ so one copy of
#                  .whl/ and .gpu/ is all a GPU run needs (scripts/gpu_run.sh uses them)
#   MAX_MIB        fail when .whl/ and .gpu/ together with the tracked files exceed this many MiB
#                  (for hosts that cap what a job may bring along; leave a few MiB to spare, as a
#                  cap may count in millions of bytes or by disk blocks)
#   SSE_SERVERS    0 leaves out the ASGI servers that only bench/bench_sse_floor.py uses (7 MiB)
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=${1:-"$repo_root/.whl"}
python=${PYTHON:-python3}

# One version of each: two versions of one name make the --no-deps install fail on the host.
packages=(
    # the GPU engines (pure Python; their CUDA extensions are prebuilt or JIT-built on the host)
    exllamav2==0.3.2
    exllamav3==1.6.5 marisa-trie==1.4.1 llguidance==1.9.1
    # worker <-> gateway link: ZeroMQ sockets, msgspec wire structs (wire/)
    pyzmq==27.3.0 msgspec==0.22.0
    # HTTP server: Quart on Hypercorn (request schemas and OpenAPI by quart-schema), and what they import
    quart-schema==0.25.0 quart==0.22.0 flask==3.1.3 werkzeug==3.1.9 blinker==1.9.0 itsdangerous==2.2.0
    click==8.5.1 hypercorn==0.18.0 h11==0.16.0 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 priority==2.0.0
    wsproto==1.3.2
    # structured output in the worker (lm-format-enforcer also needs packaging and pyyaml: in the image)
    lm-format-enforcer==0.11.3 interegular==0.3.3
    # registry and request schemas
    pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0
    # request tracing (gateway/observability/tracing.py imports the API at start; the SDK when asked)
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
    # the OpenAI SDK used by tests and benchmarks, with its HTTP stack
    openai==3.54.0 jiter==0.19.0 sniffio==1.3.1 anyio==4.16.0 idna==3.20 distro==1.9.0
    httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
    # the benchmarks' HTTP client (bench/streams.py)
    aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0
    multidict==6.9.1 propcache==0.5.4 yarl==1.25.1
)
# other ASGI servers that bench/bench_sse_floor.py --servers puts beside Hypercorn (bench only)
[[ ${SSE_SERVERS:-1} == 0 ]] || packages+=(uvicorn==0.54.0 httptools==0.9.0 granian==2.8.9)

mkdir -p "$dest"
# pip matches each manylinux tag literally, so every tag a wheel may carry is named (llguidance is
# manylinux_2_31, marisa-trie manylinux_2_24).
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$dest" "${packages[@]}"

# Drop wheels of other versions left from an older run: they would collide on install.
wanted=$(printf '%s\n' "${packages[@]}" | sed -E 's/==/-/; s/[-_.]+/_/g' | tr '[:upper:]' '[:lower:]')
for wheel in "$dest"/*.whl; do
    stem=$(basename "$wheel" | cut -d- -f1-2 | sed -E 's/[-_.]+/_/g' | tr '[:upper:]' '[:lower:]')
    grep -qx "$stem" <<<"$wanted" || { echo "removing stale $(basename "$wheel")"; rm -f "$wheel"; }
done

if [[ -n "${PREBUILT_DIR:-}" ]]; then
    mkdir -p "$repo_root/.gpu"
    for build in "$PREBUILT_DIR"/exllamav2_ext-*.so.xz "$PREBUILT_DIR"/exllamav3_ext-*.so.xz \
                 "$PREBUILT_DIR"/flash_attn-*.tar.xz; do
        [[ -f "$build" ]] || continue
        name=$(basename "$build")
        case $name in  # stable names, so gpu_run.sh finds them whatever the build's version tag
            exllamav2_ext-*) cp -f "$build" "$repo_root/.gpu/exllamav2_ext.so.xz" ;;
            exllamav3_ext-*) cp -f "$build" "$repo_root/.gpu/exllamav3_ext.so.xz" ;;
            flash_attn-*) cp -f "$build" "$repo_root/.gpu/flash_attn.tar.xz" ;;
        esac
    done
fi

# Keep the carried folders out of git even in worktrees without our .gitignore.
exclude="$repo_root/.git/info/exclude"
if [[ -d "$repo_root/.git" ]]; then
    mkdir -p "$(dirname "$exclude")"
    for pattern in /.whl/ /.gpu/; do
        grep -qxF "$pattern" "$exclude" 2>/dev/null || echo "$pattern" >>"$exclude"
    done
fi

count=$(find "$dest" -name '*.whl' | wc -l)
size=$(du -sm "$dest" | cut -f1)
echo "wheelhouse: $count wheels, ${size} MiB in $dest"
carried=("$dest")
[[ -d "$repo_root/.gpu" ]] && carried+=("$repo_root/.gpu")
total_bytes=$(du -sbc "${carried[@]}" | tail -1 | cut -f1)
tracked_bytes=$(git -C "$repo_root" ls-files -z | (cd "$repo_root" && xargs -0 -r du -bc 2>/dev/null) |
    awk '$2 == "total" { sum += $1 } END { print sum + 0 }')
total=$(((total_bytes + tracked_bytes + 1048575) / 1048576))  # rounded up: the cap is strict
echo "with .gpu/ and the tracked files: ${total} MiB"
if [[ -n "${MAX_MIB:-}" ]] && ((total > MAX_MIB)); then
    echo "more than MAX_MIB=${MAX_MIB} MiB (SSE_SERVERS=0 leaves out 7 MiB of bench-only servers)" >&2
    exit 1
fi
