#!/usr/bin/env bash
# Writes the files kustomization.yaml's secretGenerator reads, under deploy/kubernetes/secrets/
# (git-ignored, mode 600):
#   curve/gateway.key, curve/gateway.key_secret   the gateway's CURVE key pair   (gateway keys)
#   curve/worker.key, curve/worker.key_secret     the workers' CURVE key pair    (gateway keys)
#   probe-key                                     the readiness probe's API key
#   api-keys.yaml                                 the keys file: the probe key and an admin key
#   admin-key.txt                                 that admin key, for you
# Run it where the package is installed (`gateway` on PATH), then: kubectl apply -k deploy/kubernetes
# Files that exist are kept; delete one to make it anew. PROBE_MODEL names the one model the probe
# key may use (the keys file has no health-only key), at one request per minute.
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
  probe="$(new_key)"
  admin="$(new_key)"
  printf '%s' "$probe" > "$out/probe-key"
  printf '%s\n' "$admin" > "$out/admin-key.txt"
  cat > "$out/api-keys.yaml" <<KEYS
# Add client keys here (sha256 of each key), then: kubectl apply -k deploy/kubernetes
keys:
  - name: k8s-readiness-probe
    key_sha256: $(sha256_hex "$probe")
    models: [${PROBE_MODEL:-llama-3.1-8b}]
    rate_limit_rpm: 1
  - name: ops
    key_sha256: $(sha256_hex "$admin")
    admin: true
    models: ["*"]
KEYS
  echo "wrote $out; the admin key is in $out/admin-key.txt"
else
  echo "kept $out/api-keys.yaml"
fi
