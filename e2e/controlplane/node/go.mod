// Wrapper module that builds the node binaries (kubelet, kube-scheduler,
// kube-proxy) of the same Kubernetes release as the control plane, from the Go
// module proxy, with the same recipe as ../k8s/go.mod (build.sh adds the
// require and one replace per k8s.io staging module).
module shardq.local/e2e/controlplane/node

go 1.25.0

tool (
	k8s.io/kubernetes/cmd/kube-proxy
	k8s.io/kubernetes/cmd/kube-scheduler
	k8s.io/kubernetes/cmd/kubelet
)
