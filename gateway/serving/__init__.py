"""The serving layer of the gateway process: the request owner, the router, outputs and priorities.

Runs in the gateway process. Stands on gateway.link (the worker link and the worker handles) and never
imports gateway.workers, which stands on the same layer.
"""
