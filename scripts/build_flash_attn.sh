#!/usr/bin/env bash
# Build a forward-only flash-attn wheel for this host's torch and CUDA, for exllamav2's paged mode.
#
# Runs on a CUDA host with nvcc, ninja and the torch the workers use (build isolation is off, so
# the wheel links against that torch), and with PyPI access for the source tarball (or give the
# tarball as FLASH_ATTN_SDIST). exllamav2 only calls flash-attn's forward kernels
# (flash_attn_func and the paged flash_attn_with_kvcache), so the build enables flash-attn's own
# FLASHATTENTION_DISABLE_BACKWARD, _DROPOUT and _ALIBI switches and targets one GPU architecture;
# that cuts the build from hours to minutes. A build made this way (2.8.3.post2, sm_90, torch
# 2.11 / CUDA 13) took 509 s on 16 cores; it is 94 MiB installed and 6 MiB as a tar.xz.
#
# Usage: scripts/build_flash_attn.sh [DEST]        (the wheel lands in DEST, default ./dist)
# Environment:
#   FLASH_ATTN_VERSION     default 2.8.3.post2
#   FLASH_ATTN_CUDA_ARCHS  compute capabilities without the dot, default: this host's first GPU (90 on H100/H200)
#   FLASH_ATTN_SDIST       a downloaded flash_attn-VERSION.tar.gz, for hosts without PyPI
#   MAX_JOBS               parallel compile jobs, default the core count (each takes a few GB of RAM)
set -euo pipefail

version=${FLASH_ATTN_VERSION:-2.8.3.post2}
dest=$(realpath -m "${1:-dist}")
archs=${FLASH_ATTN_CUDA_ARCHS:-$(python3 -c "import torch; print('%d%d' % torch.cuda.get_device_capability(0))")}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ -n "${FLASH_ATTN_SDIST:-}" ]]; then
    cp "$FLASH_ATTN_SDIST" "$work/"
else
    python3 -m pip download -q --no-deps --no-binary :all: --no-build-isolation "flash-attn==$version" -d "$work"
fi
tar xzf "$work"/flash_attn-*.tar.gz -C "$work"
cd "$work"/flash_attn-*/

# flash-attn's setup.py lists these switches commented out; turn them on, and fail if they moved.
python3 - <<'PY'
import pathlib, re, sys
setup = pathlib.Path("setup.py")
text = setup.read_text()
for switch in ("BACKWARD", "DROPOUT", "ALIBI"):
    text, count = re.subn(rf'#\s*("-DFLASHATTENTION_DISABLE_{switch}",)', r"\1", text)
    if not count:
        sys.exit(f"setup.py has no FLASHATTENTION_DISABLE_{switch} switch to enable; check this version")
setup.write_text(text)
PY

started=$(date +%s)
FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS=$archs MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    python3 -m pip wheel -q --no-build-isolation --no-deps -w "$dest" .
wheel=$(ls -t "$dest"/flash_attn-*.whl | head -1)
echo "built $(basename "$wheel") ($(du -h "$wheel" | cut -f1)) in $(($(date +%s) - started)) s for sm_$archs"

# The wheel must import next to this torch and give exllamav2 its paged attention.
check=$(mktemp -d)
python3 -m pip install -q --no-deps --target "$check" "$wheel"
PYTHONPATH=$check python3 -c "import flash_attn, flash_attn_2_cuda; print('flash_attn', flash_attn.__version__, 'imports')"
rm -rf "$check"
