"""Worker process entry point (`model-worker`): pins GPUs, ties its life to the parent, serves.

Runs in the worker process. Owns process-level set-up that must happen before torch is imported:
`CUDA_VISIBLE_DEVICES`, the parent-death signal, logging. The gateway spawns it with
`python -m model_worker --connect ipc://... --worker-id ID --spec JSON`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys

logger = logging.getLogger("model_worker")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask the kernel to SIGTERM us when the gateway dies, so no orphan keeps a GPU."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        logger.warning("prctl(PR_SET_PDEATHSIG) unavailable; relying on the parent-pid watch")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="model-worker", description=__doc__.splitlines()[0])
    parser.add_argument("--connect", required=True, help="gateway endpoint, e.g. ipc:///run/gw/workers.sock")
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--spec", required=True, help="JSON worker spec written by the gateway")
    parser.add_argument(
        "--gpus", default=None, help="comma-separated GPU indices (sets CUDA_VISIBLE_DEVICES)"
    )
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    parser.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s worker={args.worker_id} %(name)s: %(message)s",
    )
    if args.gpus is not None:
        # Must precede any torch import (engines import torch lazily) or CUDA sees every GPU.
        os.environ["CUDA_VISIBLE_DEVICES"] = args.gpus
    _die_with_parent()
    try:
        spec = json.loads(args.spec)
    except json.JSONDecodeError as exc:
        logger.error("invalid --spec: %s", exc)
        return 2

    from model_worker.serve_loop import Worker

    worker = Worker(args.worker_id, args.connect, spec, parent_pid=args.parent_pid or os.getppid())
    signal.signal(signal.SIGTERM, lambda *_: worker.request_stop(grace_s=0.0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the gateway decides
    return worker.run()


if __name__ == "__main__":
    raise SystemExit(main())
