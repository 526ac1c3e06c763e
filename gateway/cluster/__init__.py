"""Pieces for running several gateways as one service: counters shared through Redis
(counters.py); worker membership and leader election on etcd (etcd_membership, etcd_leader) or on
the Kubernetes API (k8s_membership, k8s_leader), which share the bases of backend_base.py, behind
the interfaces of membership.py and chosen by backends.py from settings.py's `ClusterConfig`;
decisions.py gates what one leader decides.

Runs in the gateway process only (a worker's own etcd registration is model_worker.registration,
which writes the record membership.py's `WorkerRecord` reads). Each module here wraps one external
system; nothing here is needed, or imported at run time, on a single host without them.
"""
