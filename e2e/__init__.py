"""Whole-system tests against a real Kubernetes control plane run as local processes
(etcd, kube-apiserver, kube-controller-manager), built by e2e/controlplane/build.sh."""
