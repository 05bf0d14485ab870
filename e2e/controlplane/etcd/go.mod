// Wrapper module that builds etcd from the Go module proxy. etcd's server
// module cannot be `go install`ed by version (its go.mod has replace
// directives), so build.sh copies this file into the cache, adds
// `require go.etcd.io/etcd/server/v3 <ETCD_VERSION>` and builds the tool.
module shardq.local/e2e/controlplane/etcd

go 1.26.0

tool go.etcd.io/etcd/server/v3
