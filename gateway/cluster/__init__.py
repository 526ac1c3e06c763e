"""Pieces for running several gateways as one service: counters shared through Redis
(counters.py); worker membership and leader election on etcd (registration, etcd_membership,
etcd_leader) or on the Kubernetes API (k8s_membership, k8s_leader), behind the interfaces of
membership.py and chosen by backends.py from settings.py's `ClusterConfig`.

Runs in the gateway process (registration.py, with membership.py and etcd_session.py, also in the
worker). Each module here wraps one external system; nothing here is needed, or imported at run
time, on a single host without them.
"""
