// Wrapper module that builds kube-apiserver, kube-controller-manager and
// kubectl from the Go module proxy. build.sh copies this file into the cache,
// adds `require k8s.io/kubernetes <K8S_VERSION>` and one replace per k8s.io
// staging module (read from k8s.io/kubernetes' own go.mod), then builds the tools.
module shardq.local/e2e/controlplane/k8s

go 1.25.0

tool (
	k8s.io/kubernetes/cmd/kube-apiserver
	k8s.io/kubernetes/cmd/kube-controller-manager
	k8s.io/kubernetes/cmd/kubectl
)
