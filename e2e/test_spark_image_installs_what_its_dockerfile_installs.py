"""The Spark image the tests build without Docker (e2e.spark_image) and
e2e/image/spark/Dockerfile install the same things: the same Debian release and
packages, the same pip requirement, the same files in the same places, the same
user, environment and entrypoint; and (checked in a running pod) exactly the wheel
set the image was tagged with, with Java and Spark where the environment says."""

from __future__ import annotations

import re
import shlex

import pytest

from e2e import spark_image
from e2e.images import DEBIAN_SUITE
from e2e.realnode import RunningNode
from e2e.shard_workloads import run_python_pod

LIST_INSTALLED = """
import importlib.metadata as metadata, os, subprocess
for dist in metadata.distributions(path=["/usr/local/lib/python3.11/dist-packages"]):
    print(f"{dist.metadata['Name'].lower().replace('_', '-')}=={dist.version}")
java = subprocess.run([os.environ["JAVA_HOME"] + "/bin/java", "-version"], capture_output=True, text=True)
print("java:" + java.stderr.split()[2].strip('"'))
print("spark-kubernetes:" + str(any(name.startswith("spark-kubernetes_")
                                    for name in os.listdir(os.environ["SPARK_HOME"] + "/jars"))))
print("uid:" + str(os.getuid()))
"""


def dockerfile_text() -> str:
    # Continuation lines joined, so each instruction is one line.
    return spark_image.DOCKERFILE.read_text().replace("\\\n", " ")


def instructions(keyword: str) -> list[str]:
    return re.findall(rf"^{keyword} (.+)$", dockerfile_text(), re.M)


def test_the_dockerfile_installs_the_same_packages_wheels_and_files() -> None:
    assert instructions("FROM") == [f"debian:{DEBIAN_SUITE}-slim"]
    (install,) = re.findall(r"apt-get install -y --no-install-recommends ([^&]+)", dockerfile_text())
    assert sorted(install.split()) == sorted(spark_image.DEBIAN_PACKAGES_SPARK)
    requirement = spark_image.PIP_REQUIREMENT_SPARK
    (pip_target,) = re.findall(r'"\$\{shardq_wheel\}(\[[^\]]*\])"', dockerfile_text())
    assert pip_target == requirement[requirement.index("[") :]
    assert "--no-index" in dockerfile_text(), "only the wheel set of the context, as the chroot build"
    copies = dict(copy.split() for copy in instructions("COPY") if not copy.startswith("wheels/"))
    assert copies == {
        spark_image.ENTRYPOINT_SOURCE.name: spark_image.ENTRYPOINT,
        spark_image.JOB_SOURCE.name: spark_image.JOB_FILE,
    }


def test_the_dockerfile_sets_the_same_user_environment_and_entrypoint() -> None:
    (useradd,) = re.findall(r"useradd ([^&]+)", dockerfile_text())
    words = shlex.split(useradd)
    assert words[words.index("--uid") + 1] == str(spark_image.SPARK_UID)
    assert words[words.index("--home-dir") + 1] == spark_image.WORK_DIR
    (env,) = instructions("ENV")
    assert set(shlex.split(env)) == {"PYTHONUNBUFFERED=1", *spark_image.SPARK_ENV}
    assert instructions("USER") == [str(spark_image.SPARK_UID)]
    assert instructions("WORKDIR") == [spark_image.WORK_DIR]
    assert instructions("ENTRYPOINT") == [f'["{spark_image.ENTRYPOINT}"]']


@pytest.mark.realnode
@pytest.mark.timeout(900)
def test_the_running_image_holds_its_wheel_set_java_17_and_spark_for_kubernetes(
    real_node: RunningNode, node_namespace: str
) -> None:
    layout = real_node.own_node("the Spark image imported into this machine's containerd")
    image = spark_image.build_spark_image()
    spark_image.ensure_imported(layout, image)
    expected = set(image.wheel_manifest.read_text().split())
    with real_node.info.api_client() as api:
        phase, logs = run_python_pod(
            api, node_namespace, name="list", image=image.name, script=LIST_INSTALLED, timeout=300
        )
    assert phase == "Succeeded", logs
    lines = logs.split()
    assert {line for line in lines if "==" in line} == expected
    assert "spark-kubernetes:True" in lines
    assert f"uid:{spark_image.SPARK_UID}" in lines
    (java,) = [line for line in lines if line.startswith("java:")]
    assert java.removeprefix("java:").startswith("17.")
