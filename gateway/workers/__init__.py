"""Worker lifecycle in the gateway process: local worker supervision, remote worker membership, loads.

Runs in the gateway process. Stands on gateway.link (the link and the worker handles) and never imports
gateway.serving, which stands on the same layer.
"""
