"""`python -m gateway`: the gateway CLI (see gateway.cli)."""

from gateway.cli import main

raise SystemExit(main())
