#!/usr/bin/env bash
# For users with Docker: the real-node tests on a kind cluster instead of this
# project's own node (e2e/realnode.py). Creates the cluster, builds the image
# with e2e/image/Dockerfile, loads it, routes the pod and Service ranges to the
# kind node (Linux: the tests talk to pods from the host), and runs:
#
#   e2e/kind/up.sh              # then the tests; KIND_CLUSTER=shardq by default
#   e2e/kind/up.sh --no-tests   # only the cluster and the image
#
# Needs docker, kind, and a Python with `.[server,dev]` installed. It cannot run
# on the project's CI machine (no Docker there); `pytest e2e -m realnode
# --cluster=kubeconfig:PATH` is the same entry against any existing cluster.
set -euo pipefail
cd "$(dirname "$0")/../.."
name="${KIND_CLUSTER:-shardq}"
kubeconfig="e2e/kind/kubeconfig"
image="${SHARDQ_E2E_IMAGE:-shardq:dev}"

if ! kind get clusters | grep -qx "${name}"; then
  kind create cluster --name "${name}" --kubeconfig "${kubeconfig}"
else
  kind get kubeconfig --name "${name}" >"${kubeconfig}"
fi

context="$(mktemp -d)"
trap 'rm -rf "${context}"' EXIT
python -m e2e.images --context "${context}"   # the wheel set the tests' own image installs
docker build -t "${image}" "${context}"
kind load docker-image "${image}" --name "${name}"

# Pod and Service addresses answer from the host only through the node container.
node_ip="$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "${name}-control-plane")"
for range in 10.244.0.0/16 10.96.0.0/12; do
  sudo ip route replace "${range}" via "${node_ip}"
done

[[ "${1:-}" == "--no-tests" ]] && exit 0
SHARDQ_E2E_IMAGE="${image}" exec python -m pytest e2e -m realnode --cluster="kubeconfig:${kubeconfig}"
