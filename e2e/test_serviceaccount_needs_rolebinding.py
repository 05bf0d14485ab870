"""RBAC is enforced: a ServiceAccount's token is denied until a RoleBinding grants it a
Role, and then allowed only within that Role's namespace and verbs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.kubecluster import ControlPlane
from e2e.polling import wait_for

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(180)]


def request_token(core: client.CoreV1Api, namespace: str, service_account: str) -> str:
    """A short-lived token for the service account, from the TokenRequest API."""
    response = core.create_namespaced_service_account_token(
        service_account,
        namespace,
        client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=600)),
    )
    assert response.status is not None
    assert response.status.token
    return response.status.token


def status_of(call: Callable[[], object]) -> int:
    """The HTTP status of calling `call` (200 when it returns)."""
    try:
        call()
    except ApiException as error:
        return int(error.status or 0)
    return 200


def test_service_account_is_denied_without_and_allowed_with_rolebinding(
    control_plane: ControlPlane, api_client: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api_client)
    rbac = client.RbacAuthorizationV1Api(api_client)
    core.create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="reader"))
    )
    token = request_token(core, namespace, "reader")

    with control_plane.bearer_token_client(token) as sa_api:
        sa_core = client.CoreV1Api(sa_api)

        def list_here() -> object:
            return sa_core.list_namespaced_config_map(namespace)

        def list_elsewhere() -> object:
            return sa_core.list_namespaced_config_map("default")

        def create_here() -> object:
            return sa_core.create_namespaced_config_map(
                namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="x"))
            )

        # Authenticated (a bad token would be 401) but not authorized.
        assert status_of(list_here) == 403

        rbac.create_namespaced_role(
            namespace,
            client.V1Role(
                metadata=client.V1ObjectMeta(name="configmap-reader"),
                rules=[client.V1PolicyRule(api_groups=[""], resources=["configmaps"], verbs=["get", "list"])],
            ),
        )
        rbac.create_namespaced_role_binding(
            namespace,
            client.V1RoleBinding(
                metadata=client.V1ObjectMeta(name="reader-reads-configmaps"),
                role_ref=client.V1RoleRef(
                    api_group="rbac.authorization.k8s.io",
                    kind="Role",
                    name="configmap-reader",
                ),
                subjects=[client.RbacV1Subject(kind="ServiceAccount", name="reader", namespace=namespace)],
            ),
        )

        # The authorizer learns of the binding through an informer: poll, don't assume.
        wait_for(
            lambda: status_of(list_here) == 200,
            timeout=30,
            what="the RoleBinding to take effect",
            interval=0.2,
        )
        assert status_of(list_elsewhere) == 403
        assert status_of(create_here) == 403
