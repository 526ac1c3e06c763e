"""Pieces for running several gateways as one service: counters shared through Redis.

Runs in the gateway process. Each module here wraps one external system; nothing here is needed,
or imported at run time, on a single host without them.
"""
