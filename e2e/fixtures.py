"""Fixtures of the e2e and contract tests: one real control plane per session, a fresh
namespace per test. A plugin loaded once by the root conftest.py (pytest_plugins), so
tests in e2e/ and tests/contract/ share one control plane."""

from __future__ import annotations

import functools
import os
import tempfile
import uuid
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.binaries import Binaries, locate_binaries, require, running_in_ci
from e2e.crds import install_crds, release_finalizers
from e2e.kubecluster import ControlPlane, compact_etcd, start_control_plane, stop_control_plane
from e2e.realnode import (
    Layout,
    NodeError,
    NodeInfo,
    RunningNode,
    check_host,
    down,
    locate_node_binaries,
    recycle_released_volumes,
    refresh_shardq_image,
    state_dir,
    status,
    up,
)

# Set to keep the work dir (certificates, kubeconfigs, etcd data, process logs) for a look.
KEEP_WORKDIR_ENV = "SHARDQ_E2E_KEEP_WORKDIR"


# The image the tests run on an existing cluster (--cluster=kubeconfig:PATH): e2e/kind/up.sh
# builds and loads it with this name.
EXTERNAL_IMAGE_ENV = "SHARDQ_E2E_IMAGE"
EXTERNAL_IMAGE_DEFAULT = "shardq:dev"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cluster",
        default="real-node",
        help="where -m realnode tests run: real-node (this machine's, e2e/realnode.py) or kubeconfig:PATH "
        f"(an existing cluster running the image ${EXTERNAL_IMAGE_ENV}, default {EXTERNAL_IMAGE_DEFAULT})",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "controlplane: runs against the binaries built by e2e/controlplane/build.sh "
        "(etcd, kube-apiserver, kube-controller-manager, kubectl, helm, promtool)",
    )
    config.addinivalue_line(
        "markers",
        "realnode: runs pods on the real single-node cluster of e2e/realnode.py (root, containerd, kubelet)",
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    plane = getattr(item, "funcargs", {}).get("control_plane")
    if report.failed and isinstance(plane, ControlPlane):
        report.sections.append(("control plane logs", plane.logs()))
    return report


@pytest.fixture(scope="session")
def binaries() -> Binaries:
    return locate_binaries()


@pytest.fixture(scope="session")
def control_plane(binaries: Binaries) -> Iterator[ControlPlane]:
    """etcd, kube-apiserver and kube-controller-manager on free 127.0.0.1 ports."""
    require(binaries.etcd, binaries.kube_apiserver, binaries.kube_controller_manager)
    workdir = Path(tempfile.mkdtemp(prefix="shardq-e2e-"))
    plane = start_control_plane(binaries, workdir=workdir)
    try:
        yield plane
    finally:
        stop_control_plane(plane, keep_workdir=bool(os.environ.get(KEEP_WORKDIR_ENV)))


@pytest.fixture(scope="session")
def kubeconfig(control_plane: ControlPlane) -> Path:
    """An admin kubeconfig (client certificate in group system:masters)."""
    return control_plane.kubeconfig


@pytest.fixture(scope="session")
def api_client(control_plane: ControlPlane) -> Iterator[client.ApiClient]:
    """The official Python client, authenticated as the admin."""
    with control_plane.api_client() as api:
        yield api


@pytest.fixture(scope="session")
def shardq_crds(api_client: client.ApiClient) -> list[str]:
    """shardq's CRDs (crds/) installed on the session's control plane."""
    return install_crds(api_client)


@pytest.fixture
def compact_etcd_history(control_plane: ControlPlane) -> Callable[[], int]:
    """Compacts etcd up to its current revision when called (as the API server does
    every five minutes); returns that revision."""
    return functools.partial(compact_etcd, control_plane)


@pytest.fixture
def namespace(control_plane: ControlPlane, api_client: client.ApiClient) -> Iterator[str]:
    """A fresh namespace for one test, deleted after it."""
    control_plane.ensure_running()
    core = client.CoreV1Api(api_client)
    name = f"e2e-{uuid.uuid4().hex[:10]}"
    core.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={"shardq.e2e/test": "true"}))
    )
    try:
        yield name
    finally:
        try:
            core.delete_namespace(name)
        except ApiException as error:
            if error.status != 404:
                raise


@pytest.fixture(scope="session")
def real_node(request: pytest.FixtureRequest, binaries: Binaries) -> Iterator[RunningNode]:
    """The cluster pods really run on: this machine's real node (e2e.realnode), reused if
    `e2e/cluster up` left one running, else brought up for the session and taken down
    after it; or, with --cluster=kubeconfig:PATH, an existing cluster (kind, ...)."""
    chosen = str(request.config.getoption("--cluster"))
    if chosen.startswith("kubeconfig:"):
        kubeconfig = Path(chosen.removeprefix("kubeconfig:")).resolve()
        if not kubeconfig.is_file():
            pytest.fail(f"--cluster: no kubeconfig at {kubeconfig}", pytrace=False)
        image = os.environ.get(EXTERNAL_IMAGE_ENV, EXTERNAL_IMAGE_DEFAULT)
        yield RunningNode(None, NodeInfo(kubeconfig=kubeconfig, shardq_image=image, kubectl=binaries.kubectl))
        return
    if chosen != "real-node":
        pytest.fail(f"--cluster must be real-node or kubeconfig:PATH, not {chosen!r}", pytrace=False)
    node_binaries = locate_node_binaries()
    require(*node_binaries.__dict__.values())
    try:
        check_host()
    except NodeError as error:
        if running_in_ci():
            pytest.fail(str(error), pytrace=False)
        pytest.skip(str(error))
    layout = Layout(state_dir())
    healthy, _ = status(layout)
    if healthy:
        yield RunningNode(layout, refresh_shardq_image(layout))
        return
    node = RunningNode(layout, up(layout))
    try:
        yield node
    finally:
        down(layout)


@pytest.fixture
def node_namespace(real_node: RunningNode) -> Iterator[str]:
    """A fresh namespace on the real node, deleted (with its pods and claims) after the test."""
    with real_node.info.api_client() as api:
        if real_node.layout is not None:
            recycle_released_volumes(api, real_node.layout)
        core = client.CoreV1Api(api)
        name = f"node-{uuid.uuid4().hex[:10]}"
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    try:
        yield name
    finally:
        with real_node.info.api_client() as api:
            try:
                client.CoreV1Api(api).delete_namespace(name)
            except ApiException as error:
                if error.status != 404:
                    raise
            # The test's operator is gone by now: shardq objects it did not get to delete
            # would keep the namespace Terminating (and the API server busy) for good.
            release_finalizers(api, name)
