"""The single-host gateway and worker import without the cluster's client libraries.

Runs in the test process, which starts one Python subprocess that refuses to import etcd's,
Kubernetes' and Redis' clients (a CUDA host given only the serving wheels lacks them).
"""

import subprocess
import sys

REFUSE_CLUSTER_CLIENTS = """
import sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"aetcd", "lightkube", "redis", "grpc"}:
            raise ImportError(f"{name} refused: the single-host path must not import it")

sys.meta_path.insert(0, Refuse())
import gateway.server, model_worker.main
"""


def test_gateway_and_worker_import_without_cluster_clients() -> None:
    done = subprocess.run([sys.executable, "-c", REFUSE_CLUSTER_CLIENTS], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
