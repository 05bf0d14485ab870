"""The image the tests build without Docker and e2e/image/Dockerfile install the same
things: the same Debian release and packages, the same pip requirement, and (checked in
a running pod) exactly the wheel set the image was tagged with."""

from __future__ import annotations

import re

import pytest

from e2e.images import DEBIAN_PACKAGES, DEBIAN_SUITE, DOCKERFILE, PIP_REQUIREMENT, images_dir
from e2e.realnode import RunningNode
from e2e.shard_workloads import run_python_pod

LIST_INSTALLED = """
import importlib.metadata as metadata
for dist in metadata.distributions(path=["/usr/local/lib/python3.11/dist-packages"]):
    print(f"{dist.metadata['Name'].lower().replace('_', '-')}=={dist.version}")
"""


def dockerfile_text() -> str:
    # Continuation lines joined, so each RUN is one line.
    return DOCKERFILE.read_text().replace("\\\n", " ")


def test_the_dockerfile_names_the_same_base_packages_and_requirement() -> None:
    text = dockerfile_text()
    assert re.search(rf"^FROM debian:{DEBIAN_SUITE}(-slim)?$", text, re.M), "same Debian release"
    (install,) = re.findall(r"apt-get install -y --no-install-recommends ([^&]+)", text)
    assert sorted(install.split()) == sorted(DEBIAN_PACKAGES)
    extras = PIP_REQUIREMENT[PIP_REQUIREMENT.index("[") :]
    (pip_target,) = re.findall(r'"\$\{shardq_wheel\}(\[[^\]]*\])"', text)
    assert pip_target == extras
    assert "--no-index" in text, "the Dockerfile installs only the wheel set of its context, as the tests do"


@pytest.mark.realnode
@pytest.mark.timeout(180)
def test_the_running_image_holds_exactly_its_wheel_set(real_node: RunningNode, node_namespace: str) -> None:
    real_node.own_node("the wheel manifest of this machine's image build")
    tag = real_node.info.shardq_image.rsplit(":", 1)[1]
    manifest = images_dir() / f"shardq-{tag}.wheels.txt"
    expected = set(manifest.read_text().split())
    with real_node.info.api_client() as api:
        phase, logs = run_python_pod(
            api, node_namespace, name="list", image=real_node.info.shardq_image, script=LIST_INSTALLED
        )
    assert phase == "Succeeded", logs
    assert set(logs.split()) == expected
