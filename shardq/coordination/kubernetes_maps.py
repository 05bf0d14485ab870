"""The cluster map kept in a ConfigMap (what the operator writes and servers follow).

Read through the API rather than from a mounted volume: the kubelet refreshes
ConfigMap volumes on its sync period (a minute by default), and a new queue should
reach the servers within a second or two.
"""

from __future__ import annotations

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from shardq.coordination.cluster_map import CLUSTER_MAP_KEY

_REQUEST_TIMEOUT_S = 5.0


class ConfigMapSource:
    """The text of one key of one ConfigMap; OSError when it cannot be read (as for a file)."""

    def __init__(self, api_client: client.ApiClient, *, namespace: str, name: str, key: str = CLUSTER_MAP_KEY) -> None:
        self._core = client.CoreV1Api(api_client)
        self.namespace = namespace
        self.name = name
        self.key = key

    def __str__(self) -> str:
        return f"ConfigMap {self.namespace}/{self.name} key {self.key}"

    def read_text(self) -> str:
        try:
            config_map = self._core.read_namespaced_config_map(
                self.name, self.namespace, _request_timeout=_REQUEST_TIMEOUT_S
            )
        except ApiException as error:
            raise OSError(f"cannot read {self}: {error.status} {error.reason}") from None
        except Exception as error:  # connection errors of any kind: the caller keeps the map it has
            raise OSError(f"cannot read {self}: {error}") from None
        text = (config_map.data or {}).get(self.key)
        if text is None:
            raise OSError(f"{self} has no key {self.key}")
        return text
