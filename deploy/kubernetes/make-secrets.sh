#!/usr/bin/env bash
# Writes the files kustomization.yaml's secretGenerator reads, under deploy/kubernetes/secrets/
# (git-ignored, mode 600):
#   curve/gateway.key, curve/gateway.key_secret   the gateway's CURVE key pair   (gateway keys)
#   curve/worker.key, curve/worker.key_secret     the workers' CURVE key pair    (gateway keys)
#   api-keys.yaml                                 the keys file: an admin key (add client keys)
#   admin-key.txt                                 that admin key, for you
# Run it where the package is installed (`gateway` on PATH), then: kubectl apply -k deploy/kubernetes
# Files that exist are kept; delete one to make it anew. (Probes need no key: /health/live and
# /health/ready are open.)
set -euo pipefail
umask 077
out="$(cd "$(dirname "$0")" && pwd)/secrets"
mkdir -p "$out/curve"

for name in gateway worker; do
  if [[ ! -f "$out/curve/$name.key_secret" ]]; then
    gateway keys "$out/curve" --name "$name"
  fi
done

new_key() { python3 -c 'import secrets; print("sk-" + secrets.token_urlsafe(32))'; }
sha256_hex() { printf '%s' "$1" | sha256sum | cut -d' ' -f1; }

if [[ ! -f "$out/api-keys.yaml" ]]; then
  admin="$(new_key)"
  printf '%s\n' "$admin" > "$out/admin-key.txt"
  cat > "$out/api-keys.yaml" <<KEYS
# Add client keys here (sha256 of each key), then: kubectl apply -k deploy/kubernetes
keys:
  - name: ops
    key_sha256: $(sha256_hex "$admin")
    admin: true
    models: ["*"]
KEYS
  echo "wrote $out; the admin key is in $out/admin-key.txt"
else
  echo "kept $out/api-keys.yaml"
fi
