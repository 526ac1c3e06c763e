"""The link-and-membership layer of the gateway process, below serving and workers.

Runs in the gateway process. Owns what both the serving layer (gateway.serving) and the worker
lifecycle (gateway.workers) stand on: the ZeroMQ link to every worker (local, remote, or dialled in
cluster mode) with its keys, the `WorkerHandle` that is each worker's state as this gateway sees it,
and the following of a cluster's membership (gateway.cluster). It imports neither layer above it;
`make lint` checks the layers with import-linter (pyproject.toml, [tool.importlinter]).
"""
