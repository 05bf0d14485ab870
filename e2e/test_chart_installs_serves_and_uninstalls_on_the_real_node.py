"""charts/shardq on the real node, as a platform team runs it: a wrong value refuses
`helm install`; `helm install --wait` makes the operator Deployment Available (two pods,
one holding the leader Lease, serving /metrics); the chart's ShardqCluster and example
Queues become Ready; `helm test` sends and receives through its test Queue; and `helm
uninstall` leaves only what the user chose to keep (the CRDs, and the servers' volumes
with retainOnDelete): the operator's leader Lease and the kept `helm test` Pod go too.
The cluster authenticates its clients (clientAuthentication kubernetes): `helm test`'s
Pod shows a projected ServiceAccount token, a call without one is refused, the operator's
own calls (a Queue's deletion asks every server) pass on the cluster's peer secret, and
the servers' ClusterRoleBinding for token reviews goes with the cluster. It serves TLS
(cluster.tls, a kubernetes.io/tls Secret made before the install, as cert-manager would):
the kubelet probes the plaintext health port, `helm test` passes trusting the Secret's
CA, a plaintext call to the client Service is refused, and the operator's own calls
(by pod IP, checking each server's peers' name against the CA it reads) go through.
Before that, Queues made by hand make `helm uninstall` refuse, deleting nothing and
naming them, until they are deleted or the release is set to leave them unserved."""

from __future__ import annotations

import datetime
import json
import socket
import ssl
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.binaries import Binaries
from e2e.certificates import not_valid_after
from e2e.cluster_tls import make_cluster_tls_secret, renew_cluster_tls_secret
from e2e.helm import CHART, helm
from e2e.polling import wait_for
from e2e.realnode import RunningNode
from shardq import Client
from shardq.errors import Unauthenticated, Unavailable
from shardq.tls import ClientTls
from tests.integration.scraping import samples, value

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(600)]

GROUP, VERSION = "shardq.io", "v1alpha1"
RELEASE = "shardq"
# Queues made by hand (kubectl apply): on the release's cluster, and on a cluster of the user's.
ON_OURS, ELSEWHERE = "made-by-hand", "on-another-cluster"
READY_S = 240.0
SERVERS = 3
TLS_SECRET = "shardq-tls"


def timed(what: str, started: float) -> None:
    print(f"chart on the real node: {what} after {time.monotonic() - started:.1f}s")


def custom_objects(api: client.ApiClient, namespace: str, plural: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = client.CustomObjectsApi(api).list_namespaced_custom_object(
        GROUP, VERSION, namespace, plural
    )["items"]
    return items


def conditions(resource: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in resource.get("status", {}).get("conditions", [])}


def ready_queues(api: client.ApiClient, namespace: str) -> set[str]:
    """Queues that are Ready with every replica in sync (what a platform team waits for)."""
    return {
        queue["metadata"]["name"]
        for queue in custom_objects(api, namespace, "queues")
        if conditions(queue).get("Ready") == "True" and conditions(queue).get("UnderReplicated") == "False"
    }


def leftovers(api: client.ApiClient, namespace: str) -> dict[str, list[str]]:
    """What is left in the namespace besides what Kubernetes itself puts in every one."""
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    rbac, batch = client.RbacAuthorizationV1Api(api), client.BatchV1Api(api)
    coordination, policy = client.CoordinationV1Api(api), client.PolicyV1Api(api)

    def names(listing: Any, *, ignore: tuple[str, ...] = ()) -> list[str]:
        return sorted(item.metadata.name for item in listing.items if item.metadata.name not in ignore)

    found = {
        "pods": names(core.list_namespaced_pod(namespace)),
        "services": names(core.list_namespaced_service(namespace)),
        "configmaps": names(core.list_namespaced_config_map(namespace), ignore=("kube-root-ca.crt",)),
        "serviceaccounts": names(core.list_namespaced_service_account(namespace), ignore=("default",)),
        "persistentvolumeclaims": names(core.list_namespaced_persistent_volume_claim(namespace)),
        "deployments": names(apps.list_namespaced_deployment(namespace)),
        "statefulsets": names(apps.list_namespaced_stateful_set(namespace)),
        "jobs": names(batch.list_namespaced_job(namespace)),
        "roles": names(rbac.list_namespaced_role(namespace)),
        "rolebindings": names(rbac.list_namespaced_role_binding(namespace)),
        "leases": names(coordination.list_namespaced_lease(namespace)),
        "poddisruptionbudgets": names(policy.list_namespaced_pod_disruption_budget(namespace)),
    }
    for plural in ("shardqclusters", "queues", "shards"):
        found[plural] = sorted(item["metadata"]["name"] for item in custom_objects(api, namespace, plural))
    return {kind: items for kind, items in found.items() if items}


def refused_uninstall(api: client.ApiClient, binaries: Binaries, kube: tuple[str, ...], namespace: str) -> str:
    """Run `helm uninstall`, which must be refused by the pre-delete hook: what it said."""
    refused = helm(binaries, "uninstall", RELEASE, *kube, "--wait", "--timeout", "2m", timeout=180)
    assert refused.returncode != 0, refused.stdout
    assert "pre-delete" in refused.stderr, refused.stderr
    core = client.CoreV1Api(api)
    # This run's Job: the one before it, deleted by helm, may still have its pod for a moment.
    job = client.BatchV1Api(api).read_namespaced_job(f"{RELEASE}-cleanup-pre-delete", namespace)
    (pod,) = core.list_namespaced_pod(namespace, label_selector=f"controller-uid={job.metadata.uid}").items
    said: str = core.read_namespaced_pod_log(pod.metadata.name, namespace)
    # Nothing of the release was deleted: its Queues stay, served by its operator.
    assert ready_queues(api, namespace) >= {"orders", "orders-dlq", "helm-test"}
    return said


def leave_others_made_by_hand(api: client.ApiClient, binaries: Binaries, kube: tuple[str, ...], namespace: str) -> None:
    """Queues made by hand stop `helm uninstall` before it deletes anything, naming them: one
    on the release's cluster until it is deleted; one elsewhere (whose cluster, made by
    hand, would go unserved) until it is deleted or the release is set to leave it."""
    custom = client.CustomObjectsApi(api)
    for name, cluster in ((ON_OURS, "default"), (ELSEWHERE, "made-by-hand")):
        custom.create_namespaced_custom_object(
            GROUP, VERSION, namespace, "queues",
            {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Queue", "metadata": {"name": name},
             "spec": {"cluster": cluster, "shards": 1, "replicas": 1}},
        )  # fmt: skip
    said = refused_uninstall(api, binaries, kube, namespace)
    assert f"queues {namespace}/{ON_OURS}, which this release did not make, are on its ShardqCluster default" in said
    custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "queues", ON_OURS)
    wait_for(
        lambda: ON_OURS not in {q["metadata"]["name"] for q in custom_objects(api, namespace, "queues")},
        timeout=120,
        what=f"Queue {ON_OURS} deleted by the operator",
    )
    said = refused_uninstall(api, binaries, kube, namespace)
    assert f"the operator still serves queues {namespace}/{ELSEWHERE}, which this release did not make" in said
    # The way out the refusal names: back to deployed, then set to leave them.
    (last,) = json.loads(helm(binaries, "history", RELEASE, *kube, "-o", "json", "--max", "1").stdout)
    assert last["status"] == "uninstalling", last
    rolled_back = helm(binaries, "rollback", RELEASE, str(last["revision"]), *kube, timeout=120)
    assert rolled_back.returncode == 0, rolled_back.stderr
    upgraded = helm(
        binaries, "upgrade", RELEASE, str(CHART), *kube, "--reuse-values", "--set", "cleanup.leaveOtherClusters=true",
        timeout=120,
    )  # fmt: skip
    assert upgraded.returncode == 0, upgraded.stderr


def why_not_ready(api: client.ApiClient, namespace: str) -> str:
    """What the cluster and its servers say when they do not get ready: its conditions, each
    server pod's state, and the end of one's log."""
    core = client.CoreV1Api(api)
    lines = [
        f"{cluster['metadata']['name']}: {cluster.get('status', {}).get('conditions')}"
        for cluster in custom_objects(api, namespace, "shardqclusters")
    ]
    pods = core.list_namespaced_pod(namespace, label_selector="app.kubernetes.io/name=shardq-server").items
    for pod in pods:
        states = [(s.state, s.restart_count) for s in pod.status.container_statuses or []]
        lines.append(f"{pod.metadata.name}: {pod.status.phase} {states}")
    for pod in pods[:1]:
        try:
            lines.append(core.read_namespaced_pod_log(pod.metadata.name, namespace, tail_lines=30))
        except ApiException as error:
            lines.append(f"no log of {pod.metadata.name}: {error.reason}")
    return "\n".join(lines)


def release_cluster_objects(api: client.ApiClient, release: str = RELEASE) -> list[str]:
    rbac = client.RbacAuthorizationV1Api(api)
    selector = f"app.kubernetes.io/instance={release},app.kubernetes.io/managed-by=Helm"
    return sorted(
        [f"clusterrole/{r.metadata.name}" for r in rbac.list_cluster_role(label_selector=selector).items]
        + [
            f"clusterrolebinding/{b.metadata.name}"
            for b in rbac.list_cluster_role_binding(label_selector=selector).items
        ]
    )


def restarts(pod: Any) -> int:
    return sum(status.restart_count for status in pod.status.container_statuses or [])


def served_expiry(address: str, ca: bytes, server_name: str) -> float:
    """The expiry of the certificate a server pod serves, from its HTTPS metrics."""
    text = scrape_over_tls(address, 9600, ca, server_name)
    return value(samples(text), "shardq_tls_certificate_expiration_timestamp_seconds")


def scrape_over_tls(address: str, port: int, ca: bytes, server_name: str) -> str:
    """A server pod's /metrics over HTTPS, checking its certificate for `server_name`
    (the pod is reached by IP, which the certificate does not carry)."""
    context = ssl.create_default_context(cadata=ca.decode())
    with (
        socket.create_connection((address, port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=server_name) as secured,
    ):
        secured.sendall(f"GET /metrics HTTP/1.0\r\nHost: {server_name}\r\n\r\n".encode())
        answer = b"".join(iter(lambda: secured.recv(65536), b""))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith((b"HTTP/1.0 200", b"HTTP/1.1 200")), head
    return body.decode()


def test_the_chart_installs_serves_passes_helm_test_and_uninstalls_cleanly(
    real_node: RunningNode, node_namespace: str, binaries: Binaries, tmp_path: Path
) -> None:
    info = real_node.info
    namespace = node_namespace
    repository, tag = info.shardq_image.rsplit(":", 1)
    kube = ("--kubeconfig", str(info.kubeconfig), "--namespace", namespace)
    values = (
        f"image.repository={repository}",
        f"image.tag={tag}",
        "image.pullPolicy=Never",
        "cluster.create=true",
        f"cluster.servers={SERVERS}",
        "cluster.leaseDuration=3s",
        "cluster.storage.size=100Mi",
        "examples.enabled=true",
        "cluster.clientAuthentication.mode=kubernetes",
        f"cluster.tls.secretName={TLS_SECRET}",
        # Only this namespace: tests sharing the node run their own operators elsewhere.
        f"operator.watchNamespaces={{{namespace}}}",
    )
    sets = [arg for value in values for arg in ("--set", value)]

    # A wrong value: nothing is installed, and the message names the field.
    refused = helm(binaries, "install", "wrong", CHART, *kube, *sets, "--set", "operator.replicas=two")
    assert refused.returncode != 0
    assert "/operator/replicas" in refused.stderr, refused.stderr
    assert "wrong" not in helm(binaries, "list", "--short", *kube).stdout

    with info.api_client() as api:
        issued = make_cluster_tls_secret(
            api, namespace, cluster="default", secret=TLS_SECRET, directory=tmp_path / "tls"
        )
    ca = issued.ca.read_bytes()
    try:
        started = time.monotonic()
        installed = helm(binaries, "install", RELEASE, CHART, *kube, *sets, "--wait", "--timeout", "4m", timeout=300)
        assert installed.returncode == 0, installed.stderr
        timed("helm install --wait (operator Deployment Available)", started)
        assert "helm test shardq" in installed.stdout, "NOTES.txt says what to do next"

        with info.api_client() as api:
            core = client.CoreV1Api(api)
            deployment = client.AppsV1Api(api).read_namespaced_deployment(f"{RELEASE}-operator", namespace)
            available = {c.type: c.status for c in deployment.status.conditions or []}
            assert available.get("Available") == "True"
            assert deployment.status.ready_replicas == 2
            operators = core.list_namespaced_pod(
                namespace, label_selector=f"app.kubernetes.io/name=shardq-operator,app.kubernetes.io/instance={RELEASE}"
            ).items
            assert len(operators) == 2
            # One of the two pods leads, through the Lease in the release's namespace.
            lease = wait_for(
                lambda: client.CoordinationV1Api(api).read_namespaced_lease("shardq-operator", namespace),
                timeout=60,
                what="the operator's leader Lease",
                retry_on=(ApiException,),
            )
            assert lease.spec.holder_identity in {pod.metadata.name for pod in operators}

            ready = wait_for(
                lambda: ready_queues(api, namespace) >= {"orders", "orders-dlq", "helm-test"} or None,
                timeout=READY_S,
                what="the example and test Queues Ready with every replica in sync",
                explain=lambda: why_not_ready(api, namespace),
            )
            assert ready
            timed("the chart's ShardqCluster and example Queues Ready", started)
            (cluster,) = custom_objects(api, namespace, "shardqclusters")
            assert cluster["metadata"]["name"] == "default"
            assert cluster["status"]["readyServers"] == SERVERS
            assert len([s for s in custom_objects(api, namespace, "shards") if s["spec"]["queue"] == "orders"]) == 4

            # The leader serves /metrics on the pod's port 9700 (reached from the host).
            leader = next(pod for pod in operators if pod.metadata.name == lease.spec.holder_identity)
            scraped = urllib.request.urlopen(f"http://{leader.status.pod_ip}:9700/metrics", timeout=5).read().decode()
            assert f'shardq_operator_reconciles_total{{cluster="{namespace}/default"}}' in scraped

            tested_at = time.monotonic()
            tested = helm(binaries, "test", RELEASE, *kube, "--logs", "--timeout", "4m", timeout=300)
            # `--logs` prints the test Pod's own account of what it did.
            assert tested.returncode == 0, tested.stdout + tested.stderr
            assert "PASS: sent, received and deleted message" in tested.stdout, tested.stdout
            print(f"chart on the real node: helm test took {time.monotonic() - tested_at:.1f}s")
            # The kubelet probes the plaintext health-only port; the Secret is mounted.
            server = core.read_namespaced_pod("default-shardq-0", namespace)
            (container,) = server.spec.containers
            assert container.readiness_probe.grpc.port == 7602
            assert [v.secret.secret_name for v in server.spec.volumes if v.secret and v.name == "tls"] == [TLS_SECRET]
            # In plaintext the client Service (its ClusterIP, from the node) serves nothing.
            service = core.read_namespaced_service("default-shardq", namespace)
            plaintext = Client(f"{service.spec.cluster_ip}:7600", route_directly=False, tls=False)
            with plaintext, pytest.raises(Unavailable):
                plaintext.list_queues()
            # Over TLS but without a token, even from where the pods are reachable, nothing is
            # served. (Checked for the server's peers' name: the operator calls pods so too.)
            tls = ClientTls(
                root_certificates=ca, server_name=f"default-shardq-0.default-shardq-peers.{namespace}.svc.cluster.local"
            )
            anonymous = Client(f"{server.status.pod_ip}:7600", route_directly=False, tls=tls)
            with anonymous, pytest.raises(Unauthenticated):
                anonymous.list_queues()
            # Its metrics port serves HTTPS and says when the mounted certificate expires.
            servers = [core.read_namespaced_pod(f"default-shardq-{n}", namespace) for n in range(SERVERS)]

            def served_expiries() -> list[float]:
                return [served_expiry(pod.status.pod_ip, ca, tls.server_name or "") for pod in servers]

            assert served_expiries() == [not_valid_after(issued.cert)] * SERVERS
            # A renewal as cert-manager writes it (a new key and certificate from the same CA,
            # in place in the Secret) reaches every server through the kubelet's update of
            # the mounted Secret, and is served without a restart.
            renewed_at = time.monotonic()
            renewed = renew_cluster_tls_secret(
                api, namespace, cluster="default", secret=TLS_SECRET, issued=issued, validity=datetime.timedelta(days=3)
            )
            wait_for(
                lambda: served_expiries() == [not_valid_after(renewed.cert)] * SERVERS,
                timeout=240,
                interval=2,
                what="every server serving the renewed certificate",
            )
            timed("the renewed certificate served by every server", renewed_at)
            now = [core.read_namespaced_pod(pod.metadata.name, namespace) for pod in servers]
            assert [(pod.metadata.uid, restarts(pod)) for pod in now] == [
                (pod.metadata.uid, restarts(pod)) for pod in servers
            ], "a renewal by the same CA restarted a server"
            with (
                Client(f"{server.status.pod_ip}:7600", route_directly=False, tls=tls) as after,
                pytest.raises(Unauthenticated),
            ):
                after.list_queues()
            binding = f"shardq:{namespace}:default:auth-delegator"
            assert client.RbacAuthorizationV1Api(api).read_cluster_role_binding(binding).subjects[0].name == (
                "default-shardq"
            )
            uninstall_at = time.monotonic()
            leave_others_made_by_hand(api, binaries, kube, namespace)
            removed = helm(binaries, "uninstall", RELEASE, *kube, "--wait", "--timeout", "4m", timeout=300)
            assert removed.returncode == 0, removed.stdout + removed.stderr
            # Left without an operator as asked: its finalizer, if any, is lifted by hand.
            custom = client.CustomObjectsApi(api)
            custom.patch_namespaced_custom_object(
                GROUP, VERSION, namespace, "queues", ELSEWHERE, {"metadata": {"finalizers": None}}
            )
            custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "queues", ELSEWHERE)
            print(
                "chart on the real node: two refused uninstalls, a rollback, an upgrade and helm uninstall "
                f"took {time.monotonic() - uninstall_at:.1f}s"
            )
            # Only the servers' volumes stay (retainOnDelete, the default); pods take a moment to go.
            kept = {"persistentvolumeclaims": [f"data-default-shardq-{n}" for n in range(SERVERS)]}
            # The shard Leases belong to the cluster: the garbage collector takes them with it.
            wait_for(
                lambda: leftovers(api, namespace) == kept,
                timeout=120,
                what=f"only the servers' PVCs left in {namespace}",
            )
            assert release_cluster_objects(api) == []
            # Not the release's, so helm does not delete it: the operator did, with the cluster.
            bindings = client.RbacAuthorizationV1Api(api).list_cluster_role_binding().items
            assert binding not in {b.metadata.name for b in bindings}
            crds = client.ApiextensionsV1Api(api).list_custom_resource_definition().items
            assert {f"{plural}.shardq.io" for plural in ("shardqclusters", "queues", "shards")} <= {
                crd.metadata.name for crd in crds
            }, "helm never deletes a chart's CRDs"
    except BaseException:
        # Leave no clusterwide operator behind for the tests after this one (its Queues'
        # finalizers need it while the namespace goes): best effort, the failure is what counts.
        helm(binaries, "uninstall", RELEASE, *kube, "--wait", "--timeout", "2m", timeout=150)
        raise
