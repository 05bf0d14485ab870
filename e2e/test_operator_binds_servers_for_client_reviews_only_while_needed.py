"""A ShardqCluster that authenticates its clients (`spec.clientAuthentication.mode:
kubernetes`) gets its servers' ServiceAccount bound to system:auth-delegator, and with
it the rights the servers use: review a client's token for the cluster's audience
(TokenReview) and ask whether that client may use a queue (SubjectAccessReview), which a
Role like the chart README's grants. The binding is cluster-scoped, so no owner
reference removes it: the operator does, once the servers no longer run with client
authentication after the mode goes back to none, and when the cluster is deleted; a
binding already gone does not hold a deletion up. An operator not allowed to look for the
binding says so once a minute, not once a pass, and holds deletions until it may.

A real API server and controller manager (the StatefulSet controller makes the server
pods, which no kubelet runs); the operator's own reconcile and deletion handler, run
in-process as the admin."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator, Mapping
from typing import Any, cast

import kopf
import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from shardq_operator import handlers, naming
from shardq_operator.client_authentication import servers_authenticating
from shardq_operator.kube import ApplyRefused, Kube
from shardq_operator.leadership import OperatorLeadership
from shardq_operator.reconciling import Reconciler

from e2e.kubecluster import ControlPlane
from e2e.polling import wait_for
from shardq.coordination.local_leases import LocalLeaseStore

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(180)]

CLUSTER = "main"
AUDIENCE = "orders.shop.example"
FINALIZER = "shardq.io/operator"


@pytest.fixture
def reconciler(api_client: client.ApiClient, namespace: str, shardq_crds: list[str]) -> Iterator[Reconciler]:
    """The operator's reconciler; the cluster's ClusterRoleBinding, which the namespace's
    deletion would not remove, is deleted after the test whatever it left."""
    reconciler = Reconciler(Kube(api_client))
    try:
        yield reconciler
    finally:
        reconciler.server_reads.stop()
        try:
            client.RbacAuthorizationV1Api(api_client).delete_cluster_role_binding(
                naming.auth_delegator_binding(namespace, CLUSTER)
            )
        except ApiException as error:
            if error.status != 404:
                raise


def make_cluster(api_client: client.ApiClient, namespace: str, client_auth: dict[str, str]) -> None:
    body = {
        "apiVersion": naming.API_VERSION,
        "kind": "ShardqCluster",
        "metadata": {"name": CLUSTER},
        "spec": {"servers": 1, "clientAuthentication": client_auth},
    }
    client.CustomObjectsApi(api_client).create_namespaced_custom_object(
        naming.GROUP, naming.VERSION, namespace, "shardqclusters", body
    )


def set_client_auth(api_client: client.ApiClient, namespace: str, client_auth: dict[str, str]) -> None:
    client.CustomObjectsApi(api_client).patch_namespaced_custom_object(
        naming.GROUP,
        naming.VERSION,
        namespace,
        "shardqclusters",
        CLUSTER,
        {"spec": {"clientAuthentication": client_auth}},
    )


def read_binding(api_client: client.ApiClient, namespace: str) -> client.V1ClusterRoleBinding | None:
    try:
        return client.RbacAuthorizationV1Api(api_client).read_cluster_role_binding(
            naming.auth_delegator_binding(namespace, CLUSTER)
        )
    except ApiException as error:
        if error.status == 404:
            return None
        raise


def server_args(api_client: client.ApiClient, namespace: str) -> list[str]:
    stateful_set = client.AppsV1Api(api_client).read_namespaced_stateful_set(naming.server_set(CLUSTER), namespace)
    args: list[str] = stateful_set.spec.template.spec.containers[0].args
    return args


def token(api_client: client.ApiClient, namespace: str, account: str, audiences: list[str]) -> str:
    """A token of `account` from the TokenRequest API (audiences []: the API server's)."""
    answer = client.CoreV1Api(api_client).create_namespaced_service_account_token(
        account,
        namespace,
        client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=audiences, expiration_seconds=600)
        ),
    )
    return str(answer.status.token)


def reviews_as_the_servers(
    control_plane: ControlPlane, api_client: client.ApiClient, namespace: str, client_token: str
) -> tuple[str, bool] | None:
    """What the servers' ServiceAccount, with its own token (as in its pod), learns of a
    client: the user its token is for `AUDIENCE`, and whether it may send to queue
    `orders`. None when the API server forbids the servers the reviews."""
    with control_plane.bearer_token_client(token(api_client, namespace, naming.account(CLUSTER), [])) as servers:
        try:
            review = client.AuthenticationV1Api(servers).create_token_review(
                client.V1TokenReview(spec=client.V1TokenReviewSpec(token=client_token, audiences=[AUDIENCE]))
            )
        except ApiException as error:
            if error.status == 403:
                return None
            raise
        assert review.status.authenticated, review.status
        user = review.status.user
        access = client.AuthorizationV1Api(servers).create_subject_access_review(
            client.V1SubjectAccessReview(
                spec=client.V1SubjectAccessReviewSpec(
                    user=user.username,
                    groups=user.groups,
                    uid=user.uid,
                    resource_attributes=client.V1ResourceAttributes(
                        group="shardq.io", resource="queues", namespace=namespace, name="orders", verb="send"
                    ),
                )
            )
        )
        return (str(user.username), bool(access.status.allowed))


def grant_send_on_orders(api_client: client.ApiClient, namespace: str, account: str) -> None:
    """The chart README's producer Role and RoleBinding."""
    rbac = client.RbacAuthorizationV1Api(api_client)
    rule = client.V1PolicyRule(
        api_groups=["shardq.io"], resources=["queues"], resource_names=["orders"], verbs=["send"]
    )
    rbac.create_namespaced_role(
        namespace, client.V1Role(metadata=client.V1ObjectMeta(name="orders-producer"), rules=[rule])
    )
    rbac.create_namespaced_role_binding(
        namespace,
        client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name="orders-producer"),
            role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name="orders-producer"),
            subjects=[client.RbacV1Subject(kind="ServiceAccount", name=account, namespace=namespace)],
        ),
    )


def test_the_servers_may_review_clients_only_while_the_cluster_authenticates_them(
    control_plane: ControlPlane, api_client: client.ApiClient, namespace: str, reconciler: Reconciler
) -> None:
    core = client.CoreV1Api(api_client)
    core.create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="checkout"))
    )
    client_token = token(api_client, namespace, "checkout", [AUDIENCE])
    make_cluster(api_client, namespace, {"mode": "none"})
    reconciler.reconcile(namespace, CLUSTER)
    assert read_binding(api_client, namespace) is None
    assert "--client-auth" not in server_args(api_client, namespace)
    assert reviews_as_the_servers(control_plane, api_client, namespace, client_token) is None

    set_client_auth(api_client, namespace, {"mode": "kubernetes", "audience": AUDIENCE})
    reconciler.reconcile(namespace, CLUSTER)
    binding = read_binding(api_client, namespace)
    assert binding is not None
    assert (binding.role_ref.kind, binding.role_ref.name) == ("ClusterRole", "system:auth-delegator")
    assert [(s.kind, s.name, s.namespace) for s in binding.subjects] == [
        ("ServiceAccount", naming.account(CLUSTER), namespace)
    ]
    assert binding.metadata.labels["shardq.io/namespace"] == namespace
    args = server_args(api_client, namespace)
    assert args[args.index("--client-auth") + 1] == "kubernetes"
    assert args[args.index("--token-audience") + 1] == AUDIENCE
    checkout = f"system:serviceaccount:{namespace}:checkout"
    # RBAC sees a new binding within moments, not at once.
    seen = wait_for(
        lambda: reviews_as_the_servers(control_plane, api_client, namespace, client_token),
        timeout=30,
        what="the servers' account allowed to review tokens",
    )
    assert seen == (checkout, False), "no Role grants it yet"
    grant_send_on_orders(api_client, namespace, "checkout")
    wait_for(
        lambda: reviews_as_the_servers(control_plane, api_client, namespace, client_token) == (checkout, True),
        timeout=30,
        what="the README's Role letting checkout send to orders",
    )

    # The StatefulSet controller makes the server's pod with client authentication.
    kube = reconciler.kube
    wait_for(
        lambda: servers_authenticating(kube.server_pods(namespace, CLUSTER)) == ["main-shardq-0"],
        timeout=60,
        what="the server pod running with --client-auth kubernetes",
    )
    set_client_auth(api_client, namespace, {"mode": "none", "audience": AUDIENCE})
    reconciler.reconcile(namespace, CLUSTER)
    assert "--client-auth" not in server_args(api_client, namespace)
    # Its pod still asks for reviews until the StatefulSet replaces it: the binding stays.
    assert read_binding(api_client, namespace) is not None

    def binding_gone() -> bool:
        reconciler.reconcile(namespace, CLUSTER)
        return read_binding(api_client, namespace) is None

    wait_for(binding_gone, timeout=60, interval=0.5, what="the binding removed once the pod runs without client auth")
    assert servers_authenticating(kube.server_pods(namespace, CLUSTER)) == []
    wait_for(
        lambda: reviews_as_the_servers(control_plane, api_client, namespace, client_token) is None,
        timeout=30,
        what="the servers' account forbidden the reviews again",
    )

    # Turned on again, the binding is made at once (not when the operator next re-applies).
    set_client_auth(api_client, namespace, {"mode": "kubernetes", "audience": AUDIENCE})
    reconciler.reconcile(namespace, CLUSTER)
    assert read_binding(api_client, namespace) is not None


def test_deleting_the_cluster_deletes_its_binding_once_its_queues_are_gone(
    api_client: client.ApiClient, namespace: str, reconciler: Reconciler, tmp_path: pathlib.Path
) -> None:
    custom = client.CustomObjectsApi(api_client)
    make_cluster(api_client, namespace, {"mode": "kubernetes"})
    queue = {
        "apiVersion": naming.API_VERSION,
        "kind": "Queue",
        "metadata": {"name": "orders"},
        "spec": {"cluster": CLUSTER},
    }
    custom.create_namespaced_custom_object(naming.GROUP, naming.VERSION, namespace, "queues", queue)
    leases = LocalLeaseStore(tmp_path / "operator-lease")
    handlers.use(reconciler, OperatorLeadership(leases, identity="test"))

    def deletion_handled() -> None:
        body = custom.get_namespaced_custom_object(naming.GROUP, naming.VERSION, namespace, "shardqclusters", CLUSTER)
        handlers.cluster_deleted(namespace=namespace, name=CLUSTER, body=cast(kopf.Body, body), retry=1)

    try:
        reconciler.reconcile(namespace, CLUSTER)
        assert read_binding(api_client, namespace) is not None
        # Deleted as kubectl deletes it, held by the finalizer as kopf holds it.
        held = {"metadata": {"finalizers": [FINALIZER]}}
        custom.patch_namespaced_custom_object(naming.GROUP, naming.VERSION, namespace, "shardqclusters", CLUSTER, held)
        custom.delete_namespaced_custom_object(naming.GROUP, naming.VERSION, namespace, "shardqclusters", CLUSTER)
        cluster: dict[str, Any] = custom.get_namespaced_custom_object(
            naming.GROUP, naming.VERSION, namespace, "shardqclusters", CLUSTER
        )
        assert cluster["metadata"].get("deletionTimestamp")

        # A Queue is still on it: its servers serve it, and need the binding meanwhile.
        with pytest.raises(kopf.TemporaryError, match="queues orders are placed on this cluster"):
            deletion_handled()
        assert read_binding(api_client, namespace) is not None

        custom.delete_namespaced_custom_object(naming.GROUP, naming.VERSION, namespace, "queues", "orders")
        deletion_handled()
        assert read_binding(api_client, namespace) is None
        # A pass that comes late (a tick, a Queue's change) does not make it anew...
        reconciler.reconcile(namespace, CLUSTER)
        assert read_binding(api_client, namespace) is None
        # ...and a deletion retried with the binding already gone goes through.
        deletion_handled()
    finally:
        leases.close()
        released = {"metadata": {"finalizers": None}}
        try:
            custom.patch_namespaced_custom_object(
                naming.GROUP, naming.VERSION, namespace, "shardqclusters", CLUSTER, released
            )
        except ApiException as error:
            if error.status != 404:
                raise


def test_a_binding_of_the_same_name_that_is_not_the_operators_is_left_alone(
    api_client: client.ApiClient, namespace: str, reconciler: Reconciler
) -> None:
    """The operator deletes only what it labelled as its own."""
    rbac = client.RbacAuthorizationV1Api(api_client)
    name = naming.auth_delegator_binding(namespace, CLUSTER)
    rbac.create_cluster_role_binding(
        client.V1ClusterRoleBinding(
            metadata=client.V1ObjectMeta(name=name, labels={"made-by": "hand"}),
            role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole", name="view"),
            subjects=[client.RbacV1Subject(kind="ServiceAccount", name="someone", namespace=namespace)],
        )
    )
    make_cluster(api_client, namespace, {"mode": "none"})
    reconciler.reconcile(namespace, CLUSTER)
    cluster = client.CustomObjectsApi(api_client).get_namespaced_custom_object(
        naming.GROUP, naming.VERSION, namespace, "shardqclusters", CLUSTER
    )
    reconciler.release(cluster)
    left = read_binding(api_client, namespace)
    assert left is not None
    assert left.role_ref.name == "view"


class ForbiddenBindings(Kube):
    """The API as an operator sees it that was not given the ClusterRoleBinding rights
    (the chart's `rbac.create=false`, the rights not granted by hand)."""

    def __init__(self, api_client: client.ApiClient) -> None:
        super().__init__(api_client)
        self.looks = 0

    def delete_cluster_role_binding(self, name: str, *, labels: Mapping[str, str]) -> bool:
        self.looks += 1
        raise ApplyRefused(f"ClusterRoleBinding {name} (deleting it): clusterrolebindings is forbidden")


def test_an_operator_without_binding_rights_says_so_once_and_keeps_reconciling_but_holds_deletion(
    api_client: client.ApiClient, namespace: str, shardq_crds: list[str], tmp_path: pathlib.Path
) -> None:
    kube = ForbiddenBindings(api_client)
    reconciler = Reconciler(kube)
    leases = LocalLeaseStore(tmp_path / "operator-lease")
    handlers.use(reconciler, OperatorLeadership(leases, identity="test"))
    make_cluster(api_client, namespace, {"mode": "none"})
    try:
        for _ in range(3):
            reconciler.reconcile(namespace, CLUSTER)
        # Looked for once, not every pass: the next look is a minute away.
        assert kube.looks == 1
        events = client.CoreV1Api(api_client).list_namespaced_event(namespace).items
        refused = [event for event in events if event.reason == "ApplyRefused"]
        assert [event.message for event in refused] == [
            f"ClusterRoleBinding {naming.auth_delegator_binding(namespace, CLUSTER)} (deleting it): "
            "clusterrolebindings is forbidden"
        ]
        # The rest of the pass was done.
        assert "--client-auth" not in server_args(api_client, namespace)
        # A deletion is held until the operator may look: a binding left behind would
        # bind the servers of a later cluster of the same name.
        body = client.CustomObjectsApi(api_client).get_namespaced_custom_object(
            naming.GROUP, naming.VERSION, namespace, "shardqclusters", CLUSTER
        )
        with pytest.raises(kopf.TemporaryError, match="clusterrolebindings is forbidden"):
            handlers.cluster_deleted(namespace=namespace, name=CLUSTER, body=cast(kopf.Body, body), retry=1)
    finally:
        reconciler.server_reads.stop()
        leases.close()
