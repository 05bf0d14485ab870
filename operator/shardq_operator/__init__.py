"""The shardq operator: ShardqCluster, Queue and Shard resources reconciled into shard servers.

`naming` and `builders` (object names and manifests), `mapping` (the cluster map a set of
resources stands for) and `observing` (servers as seen through their pods) are pure;
`kube` is the only module that talks to the Kubernetes API; `reconciling` puts them
together; `handlers` registers it all with kopf; `python -m shardq_operator` runs it.
"""
