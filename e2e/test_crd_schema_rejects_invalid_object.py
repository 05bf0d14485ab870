"""A CustomResourceDefinition becomes Established, and its OpenAPI schema rejects a bad object."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.polling import wait_for

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(180)]

GROUP = "e2e.shardq.io"
PLURAL = "widgets"
CRD_NAME = f"{PLURAL}.{GROUP}"


def build_widget_crd() -> client.V1CustomResourceDefinition:
    schema = client.V1JSONSchemaProps.from_dict(
        {
            "type": "object",
            "required": ["spec"],
            "properties": {
                "spec": {
                    "type": "object",
                    "required": ["replicas"],
                    "properties": {
                        "replicas": {"type": "integer", "minimum": 1, "maximum": 5},
                        "mode": {"type": "string", "enum": ["standard", "fifo"]},
                    },
                }
            },
        }
    )
    return client.V1CustomResourceDefinition(
        metadata=client.V1ObjectMeta(name=CRD_NAME),
        spec=client.V1CustomResourceDefinitionSpec(
            group=GROUP,
            scope="Namespaced",
            names=client.V1CustomResourceDefinitionNames(
                plural=PLURAL, singular="widget", kind="Widget", list_kind="WidgetList"
            ),
            versions=[
                client.V1CustomResourceDefinitionVersion(
                    name="v1",
                    served=True,
                    storage=True,
                    schema=client.V1CustomResourceValidation(open_apiv3_schema=schema),
                )
            ],
        ),
    )


def widget(name: str, spec: dict[str, object]) -> dict[str, object]:
    return {
        "apiVersion": f"{GROUP}/v1",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": spec,
    }


@pytest.fixture
def widget_crd(api_client: client.ApiClient) -> Iterator[None]:
    extensions = client.ApiextensionsV1Api(api_client)
    extensions.create_custom_resource_definition(build_widget_crd())
    try:
        yield
    finally:
        extensions.delete_custom_resource_definition(CRD_NAME)


def is_established(api_client: client.ApiClient) -> bool:
    crd = client.ApiextensionsV1Api(api_client).read_custom_resource_definition(CRD_NAME)
    conditions = crd.status.conditions if crd.status else None
    return any(c.type == "Established" and c.status == "True" for c in conditions or [])


def test_crd_is_established_and_schema_rejects_invalid_object(
    api_client: client.ApiClient, namespace: str, widget_crd: None
) -> None:
    wait_for(
        lambda: is_established(api_client),
        timeout=30,
        what=f"CRD {CRD_NAME} Established",
    )
    objects = client.CustomObjectsApi(api_client)

    # The custom-objects API is untyped: its answers are plain JSON objects.
    created = cast(
        dict[str, Any],
        objects.create_namespaced_custom_object(
            GROUP,
            "v1",
            namespace,
            PLURAL,
            widget("good", {"replicas": 3, "mode": "fifo"}),
        ),
    )
    assert created["spec"] == {"replicas": 3, "mode": "fifo"}

    invalid: list[tuple[str, dict[str, object], str]] = [
        ("too-many", {"replicas": 9}, "spec.replicas"),
        ("not-a-number", {"replicas": "three"}, "spec.replicas"),
        ("bad-mode", {"replicas": 1, "mode": "lifo"}, "spec.mode"),
        ("no-replicas", {}, "spec.replicas"),
    ]
    for name, spec, field in invalid:
        with pytest.raises(ApiException) as rejected:
            objects.create_namespaced_custom_object(GROUP, "v1", namespace, PLURAL, widget(name, spec))
        assert rejected.value.status == 422, rejected.value.body
        assert field in str(rejected.value.body), rejected.value.body

    listed = cast(
        dict[str, Any],
        objects.list_namespaced_custom_object(GROUP, "v1", namespace, PLURAL),
    )
    names = [item["metadata"]["name"] for item in listed["items"]]
    assert names == ["good"]
