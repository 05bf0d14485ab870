"""`shardq local`: a supervisor that runs a replicated cluster as processes on 127.0.0.1.

It observes (processes, leases, replica status), asks the pure decisions in
`shardq.coordination.placement` and `shardq.coordination.fencing` what to do, and carries the answer
out as a lease compare-and-swap or a process start or stop. The decisions over what it
observed live in `takeovers`, which does no I/O and reads no clock; the operator never
appears here (it makes the same decisions for Kubernetes, from the same functions).
"""
