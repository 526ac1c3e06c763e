"""`python -m model_worker`: the worker process entry point (see model_worker.main)."""

from model_worker.main import main

raise SystemExit(main())
