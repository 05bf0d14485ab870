"""A ShardqCluster with spec.tls whose Secret is missing, or lacks a key, is reported by
name and key (the TlsReady condition, the Ready reason `kubectl get` shows, one Warning
Event per problem), and its servers are not rolled to pods that could not start: no
StatefulSet is made, and one already running is left as it is. Once the Secret is whole
the servers get it, and the operator's own calls trust its ca.crt, read through the API.

A real API server (no kubelet); the operator's own reconcile, run in-process on the
admin's client."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from shardq_operator import naming
from shardq_operator.kube import Kube
from shardq_operator.reconciling import Reconciler
from shardq_operator.transport_security import CallTls, TlsSecretProblem

from e2e.certificates import issue_serving_certificates
from e2e.crds import status_condition
from e2e.polling import wait_for

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(120)]

SECRET = "main-tls"


def tls_secret(data: dict[str, bytes]) -> client.V1Secret:
    return client.V1Secret(
        metadata=client.V1ObjectMeta(name=SECRET),
        type="Opaque",  # kubernetes.io/tls would refuse the short Secret this test needs
        data={key: base64.b64encode(value).decode() for key, value in data.items()},
    )


def tls_events(core: client.CoreV1Api, namespace: str) -> list[str]:
    events = core.list_namespaced_event(namespace).items
    return [str(event.message) for event in events if event.reason == "TlsSecretNotUsable"]


def test_a_missing_or_short_secret_is_named_and_holds_the_servers_back_until_it_is_whole(
    api_client: client.ApiClient, namespace: str, shardq_crds: list[str], tmp_path: Path
) -> None:
    custom = client.CustomObjectsApi(api_client)
    core = client.CoreV1Api(api_client)
    apps = client.AppsV1Api(api_client)
    body = {
        "apiVersion": naming.API_VERSION,
        "kind": "ShardqCluster",
        "metadata": {"name": "main"},
        "spec": {"servers": 2, "tls": {"secretName": SECRET}},
    }
    custom.create_namespaced_custom_object(naming.GROUP, naming.VERSION, namespace, "shardqclusters", body)
    certificates = issue_serving_certificates(
        tmp_path, dns_names=[f"*.main-shardq-peers.{namespace}.svc.cluster.local"]
    )
    ca = certificates.ca.read_bytes()
    reconciler = Reconciler(Kube(api_client))
    try:
        # No Secret: said, twice reconciled but said once, and no servers made.
        reconciler.reconcile(namespace, "main")
        reconciler.reconcile(namespace, "main")
        tls_ready = status_condition(api_client, namespace, "shardqclusters", "main", "TlsReady")
        ready = status_condition(api_client, namespace, "shardqclusters", "main", "Ready")
        assert (tls_ready["status"], tls_ready["reason"]) == ("False", "TlsSecretNotUsable"), tls_ready
        assert f"Secret {SECRET} (spec.tls.secretName) in namespace {namespace} does not exist" in tls_ready["message"]
        assert (ready["status"], ready["reason"]) == ("False", "TlsSecretNotUsable"), ready
        assert "does not exist" in ready["message"]
        said = tls_events(core, namespace)
        assert len(said) == 1, said
        assert f"Secret {SECRET}" in said[0]
        with pytest.raises(ApiException) as absent:
            apps.read_namespaced_stateful_set(naming.server_set("main"), namespace)
        assert absent.value.status == 404

        # A Secret without its CA: the key is named.
        core.create_namespaced_secret(
            namespace,
            tls_secret({"tls.crt": certificates.cert.read_bytes(), "tls.key": certificates.key.read_bytes()}),
        )
        reconciler.reconcile(namespace, "main")
        tls_ready = status_condition(api_client, namespace, "shardqclusters", "main", "TlsReady")
        assert tls_ready["status"] == "False"
        assert f"Secret {SECRET} (spec.tls.secretName) in namespace {namespace} has no ca.crt" in tls_ready["message"]
        assert len(tls_events(core, namespace)) == 2
        with pytest.raises(ApiException):
            apps.read_namespaced_stateful_set(naming.server_set("main"), namespace)

        # Whole: the servers are made, serving TLS from it.
        core.patch_namespaced_secret(SECRET, namespace, {"data": {"ca.crt": base64.b64encode(ca).decode()}})
        reconciler.reconcile(namespace, "main")
        tls_ready = status_condition(api_client, namespace, "shardqclusters", "main", "TlsReady")
        assert (tls_ready["status"], tls_ready["reason"]) == ("True", "TlsSecretUsable"), tls_ready
        server_set = apps.read_namespaced_stateful_set(naming.server_set("main"), namespace)
        pod_spec = server_set.spec.template.spec
        assert [volume.secret.secret_name for volume in pod_spec.volumes if volume.name == "tls"] == [SECRET]
        assert server_set.spec.replicas == 2

        # The operator's own calls: to a pod serving from the Secret (the StatefulSet
        # controller's, not scheduled here), TLS with its ca.crt.
        owner = custom.get_namespaced_custom_object(naming.GROUP, naming.VERSION, namespace, "shardqclusters", "main")
        pods = wait_for(
            lambda: (
                [p for p in reconciler.kube.server_pods(namespace, "main") if p["metadata"]["name"] == "main-shardq-0"]
                or None
            ),
            timeout=60,
            what="the StatefulSet's first pod",
        )
        calls = reconciler.call_tls_of_servers(owner, pods)
        assert calls == {
            "main-shardq-0": CallTls(
                ca_certificates=ca, server_name=f"main-shardq-0.main-shardq-peers.{namespace}.svc.cluster.local"
            )
        }

        # The Secret gone while servers run: they are left as they are (a scale-out waits).
        core.delete_namespaced_secret(SECRET, namespace)
        custom.patch_namespaced_custom_object(
            naming.GROUP, naming.VERSION, namespace, "shardqclusters", "main", {"spec": {"servers": 3}}
        )
        reconciler.reconcile(namespace, "main")
        assert apps.read_namespaced_stateful_set(naming.server_set("main"), namespace).spec.replicas == 2
        tls_ready = status_condition(api_client, namespace, "shardqclusters", "main", "TlsReady")
        assert tls_ready["status"] == "False"
        assert "does not exist" in tls_ready["message"]
        # ...and a pod serving from it cannot be checked, which the operator says rather than call it.
        (call,) = reconciler.call_tls_of_servers(owner, pods).values()
        assert isinstance(call, TlsSecretProblem)
        assert f"Secret {SECRET}" in call.message
    finally:
        reconciler.server_reads.stop()
