"""kopf logs in with the operator's own credentials: a kubeconfig's token and, in a pod,
the service account token the Kubernetes client keeps as `BearerToken` ("bearer ...").
Without the second, the operator in a pod watched as system:anonymous and got 403."""

from __future__ import annotations

from typing import cast

import pytest
from kubernetes import client
from shardq_operator import handlers
from shardq_operator.kube import Kube
from shardq_operator.leadership import OperatorLeadership
from shardq_operator.reconciling import Reconciler


@pytest.mark.parametrize(
    ("api_key", "token"),
    [
        ({"BearerToken": "bearer pod-token"}, "pod-token"),
        ({"authorization": "Bearer kubeconfig-token"}, "kubeconfig-token"),
        ({}, None),
    ],
)
def test_login_hands_kopf_the_clients_token(api_key: dict[str, str], token: str | None) -> None:
    configuration = client.Configuration()
    configuration.host = "https://198.19.0.1:443"
    configuration.api_key = dict(api_key)
    with client.ApiClient(configuration) as api:
        handlers.use(Reconciler(Kube(api)), cast(OperatorLeadership, None))
        info = handlers.login()
    assert info.server == "https://198.19.0.1:443"
    assert info.token == token
    assert info.scheme == ("Bearer" if token else None)
