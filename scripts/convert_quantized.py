#!/usr/bin/env python3
"""Convert an FP16 model folder to EXL2 and EXL3 with the libraries' own converters, timed and sized.

A development tool for a CUDA host with exllamav2 and/or exllamav3 installed (scripts/gpu_run.sh,
stage real-model, runs it), never part of the gateway or a worker. Each conversion runs in its own
process, as its library documents it (neither wheel ships a convert.py):

    python -m exllamav2.conversion.convert_exl2 -i IN -o WORK -cf OUT -b BITS -hb 6
    python -m exllamav3.conversion.convert_model -i IN -w WORK -o OUT -b BITS -hb 6

Both use the calibration text their wheel ships. Two traps are handled on the way:
- exllamav2's converter imports pandas and fastparquet at start-up, though it reads them only for
  a parquet calibration file. When they are not installed, the conversion runs with stand-ins that
  fail loudly if anything touches them (the bundled text never does), so a host need not carry
  16 MB of wheels for an import.
- exllamav2 reads only a top-level rope_theta/rope_scaling, and transformers 5 nests them under
  rope_parameters: converting such a folder as it is would calibrate with rope_theta 10000. The
  converter is given a staging folder (links to the weights, and a config.json that also has the
  top-level keys, from model_worker.engines.exllamav2.rope), so the EXL2 folder it writes carries
  both spellings and reads right everywhere.

Prints one line per format (seconds, folder size, bits per weight as the files hold them) and
writes them as JSON (--report). A finished output folder (it has config.json) is reused. A run
stopped with SIGTERM (`timeout`) keeps the converter's checkpoint; `--resume` goes on from it, and
the seconds reported then add up every run's (with the number of runs).

    python3 scripts/convert_quantized.py MODEL_DIR OUT_ROOT [--bits 4.0] [--formats exl2,exl3] [--resume]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import runpy
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CONVERTERS = {"exl2": "exllamav2.conversion.convert_exl2", "exl3": "exllamav3.conversion.convert_model"}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def weight_bits_per_parameter(quantized: Path, source: Path) -> float:
    """Bits of the quantized folder's tensor files per parameter of the FP16 source (head and
    embeddings included, as the folder holds them)."""
    from safetensors import safe_open

    params = 0
    for file in source.glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            params += sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys())
    tensor_bytes = sum(f.stat().st_size for f in quantized.glob("*.safetensors"))
    return 8.0 * tensor_bytes / max(params, 1)


def stage_for_exllamav2(source: Path, stage: Path) -> Path:
    """A folder exllamav2 reads right: links to every file, config.json with the top-level keys."""
    sys.path.insert(0, str(REPO))
    from model_worker.engines.exllamav2.rope import read_config, rope_overrides

    config = read_config(source)
    rope_overrides(config)  # refuses, by field, what exllamav2 cannot honour
    params = config.get("rope_parameters") or {}
    if not params:
        return source
    legacy = dict(config)
    if "rope_theta" in params:
        legacy.setdefault("rope_theta", params["rope_theta"])
    if params.get("rope_type", "default") != "default":
        legacy.setdefault("rope_scaling", {k: v for k, v in params.items() if k != "rope_theta"})
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    for item in source.iterdir():
        if item.name != "config.json":
            (stage / item.name).symlink_to(item.resolve())
    (stage / "config.json").write_text(json.dumps(legacy, indent=2) + "\n")
    return stage


def convert(
    fmt: str,
    source: Path,
    out: Path,
    work: Path,
    bits: float,
    head_bits: int,
    cal_length: int,
    resume: bool = False,
) -> float:
    """Run one converter in a child process; returns its seconds. With resume, the job saved in
    WORK by an interrupted run goes on from its last checkpoint (both converters checkpoint)."""
    if fmt == "exl3" and resume:
        inner = ["-w", str(work / "job"), "-r"]  # the saved job holds the input, output and bits
    elif fmt == "exl2":
        inner = [
            "-i",
            str(stage_for_exllamav2(source, work / "input")),
            "-o",
            str(work / "job"),
            "-cf",
            str(out),
            "-b",
            str(bits),
            "-hb",
            str(head_bits),
            "-l",
            str(cal_length),
            "-ml",
            str(cal_length),
            *([] if resume else ["-nr"]),  # without -nr, exllamav2 goes on with the job it finds
        ]
    else:
        inner = [
            "-i",
            str(source),
            "-w",
            str(work / "job"),
            "-o",
            str(out),
            "-b",
            str(bits),
            "-hb",
            str(head_bits),
            "-cc",
            str(cal_length),
        ]
    command = [sys.executable, str(Path(__file__).resolve()), "--run-converter", fmt, "--", *inner]
    print(f"[convert] {fmt}: {' '.join(inner)}", flush=True)
    started = time.monotonic()
    subprocess.run(command, check=True)
    return time.monotonic() - started


def run_converter(fmt: str, argv: list[str]) -> None:
    """In the child: the converter module as __main__, with stand-ins for unused parquet readers."""
    if fmt == "exl2":
        for name in ("pandas", "fastparquet"):
            if importlib.util.find_spec(name) is None:
                sys.modules[name] = _absent(name)
    sys.argv = [CONVERTERS[fmt], *argv]
    runpy.run_module(CONVERTERS[fmt], run_name="__main__", alter_sys=True)


def _absent(name: str) -> types.ModuleType:
    module = types.ModuleType(name)

    def refuse(attribute: str) -> Any:
        if attribute.startswith("__"):  # module introspection (inspect, pickle) must see a plain module
            raise AttributeError(attribute)
        raise ImportError(f"{name} is not installed: install it to convert with a parquet calibration file")

    module.__getattr__ = refuse  # type: ignore[method-assign]
    return module


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--run-converter":
        run_converter(sys.argv[2], sys.argv[4:] if sys.argv[3:4] == ["--"] else sys.argv[3:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out_root", type=Path)
    parser.add_argument("--bits", type=float, default=4.0)
    parser.add_argument("--head-bits", type=int, default=6)
    parser.add_argument("--formats", default="exl2,exl3")
    parser.add_argument("--cal-length", type=int, default=2048, help="tokens per calibration row")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default OUT_ROOT/.work)")
    parser.add_argument("--report", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="go on with a conversion that an earlier run left unfinished in the scratch folder "
        "(a conversion longer than one job's time limit, in several runs on one host)",
    )
    args = parser.parse_args()
    # `timeout` stops a run with SIGTERM: end the converter and keep its checkpoint and time.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    source = args.model_dir.resolve()
    results: list[dict[str, Any]] = []
    fp16_bytes = folder_bytes(source)
    for fmt in [f.strip() for f in args.formats.split(",") if f.strip()]:
        if fmt not in CONVERTERS:
            parser.error(f"unknown format {fmt!r}; choose from {', '.join(CONVERTERS)}")
        out = args.out_root / f"{source.name}-{fmt}-{args.bits:g}bpw"
        row: dict[str, Any] = {"format": fmt, "bits": args.bits, "folder": str(out)}
        if (out / "config.json").is_file():
            row["seconds"] = None  # made by an earlier run on this host
        else:
            work = (args.work or args.out_root / ".work") / fmt
            spent_file = work / "seconds_so_far"
            resume = args.resume and (work / "job").is_dir()
            if not resume:
                shutil.rmtree(out, ignore_errors=True)  # an interrupted conversion's leftovers
                shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True, exist_ok=True)
            spent_before = float(spent_file.read_text()) if resume and spent_file.is_file() else 0.0
            started = time.monotonic()
            try:
                seconds = convert(fmt, source, out, work, args.bits, args.head_bits, args.cal_length, resume)
                row["seconds"] = round(spent_before + seconds, 1)
                row["runs"] = (
                    int((work / "runs").read_text()) + 1 if resume and (work / "runs").is_file() else 1
                )
            except subprocess.CalledProcessError as exc:
                row["error"] = f"converter exited with {exc.returncode}"
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(work, ignore_errors=True)
                results.append(row)
                continue
            except SystemExit:  # stopped from outside: what it did stays for --resume
                spent_file.write_text(str(spent_before + time.monotonic() - started))
                runs = work / "runs"
                runs.write_text(str(int(runs.read_text()) + 1 if runs.is_file() else 1))
                print(f"[convert] {fmt}: stopped; run again with --resume to go on", flush=True)
                raise
            shutil.rmtree(work, ignore_errors=True)
        row["mib"] = round(folder_bytes(out) / 2**20, 1)
        row["fp16_mib"] = round(fp16_bytes / 2**20, 1)
        row["bits_per_parameter"] = round(weight_bits_per_parameter(out, source), 2)
        results.append(row)
        print(f"[convert] {fmt}: {row}", flush=True)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)  # a run's first stage may be this one
        args.report.write_text(json.dumps(results, indent=2) + "\n")
    print("\n| format | target bpw | seconds | MiB (FP16 MiB) | bits per parameter |\n|---|---|---|---|---|")
    for row in results:
        if "error" in row:
            print(f"| {row['format']} | {row['bits']} | failed: {row['error']} | | |")
        else:
            print(
                f"| {row['format']} | {row['bits']} | {row['seconds']} | {row['mib']} ({row['fp16_mib']}) "
                f"| {row['bits_per_parameter']} |"
            )
    return 1 if any("error" in row for row in results) else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
