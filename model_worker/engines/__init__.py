"""Engines a worker can run, one module each, behind the interface in `base.py` (worker process)."""
