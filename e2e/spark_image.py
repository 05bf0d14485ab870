"""The Spark image of the analytics report, built like the shard-server image (e2e.images):
no Docker, no registry.

`localhost/shardq-spark:<hash>`: Debian bookworm minbase with a Java 17 runtime and
Python 3.11, `shardq[spark]` (pyspark, pyarrow, pandas, matplotlib) installed offline
from wheels made on the host, Spark's Kubernetes entrypoint (e2e/image/spark/entrypoint.sh)
and the job file spark-submit runs (local:///opt/shardq/report_job.py), user 185 as in
Spark's own images. The tag is the content hash of the wheels, the files and this recipe,
so an unchanged image is reused. e2e/image/spark/Dockerfile is the same image for Docker
users; a test checks that both install the same things.

    python -m e2e.spark_image                 # build (or reuse); prints name and archive
    python -m e2e.spark_image --context DIR   # a `docker build` context instead
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from e2e.images import (
    DEBIAN_PACKAGES,
    REPO_ROOT,
    WHEELS_IN_IMAGE,
    Image,
    base_rootfs,
    images_dir,
    log,
    pack_image,
    wheel_contents_hash,
    wheel_requirement,
)
from e2e.realnode import Layout, _ctr, _import_images, run

IMAGE_FILES = Path(__file__).parent / "image" / "spark"
DOCKERFILE = IMAGE_FILES / "Dockerfile"
ENTRYPOINT_SOURCE = IMAGE_FILES / "entrypoint.sh"
JOB_SOURCE = IMAGE_FILES / "report_job.py"
# Bumped when the way the image is built changes, so cached images are redone.
RECIPE = "1"
# The shard-server image's packages plus a Java runtime for Spark and `ps`, which
# Spark's scripts use; the Dockerfile installs the same.
DEBIAN_PACKAGES_SPARK = (*DEBIAN_PACKAGES, "openjdk-17-jre-headless", "procps")
PIP_REQUIREMENT_SPARK = "shardq[spark]"
REPOSITORY = "localhost/shardq-spark"
# Where the files live in the image.
ENTRYPOINT = "/opt/entrypoint.sh"
JOB_FILE = "/opt/shardq/report_job.py"
APPLICATION = f"local://{JOB_FILE}"
WORK_DIR = "/opt/spark/work-dir"
SPARK_UID = 185
# pip installs into Debian's /usr/local; Spark (jars, bin/spark-submit) is the pyspark package.
SPARK_ENV = (
    "JAVA_HOME=/usr/lib/jvm/java-17-openjdk-amd64",
    "SPARK_HOME=/usr/local/lib/python3.11/dist-packages/pyspark",
    "PYSPARK_PYTHON=python3",
)
# Wheels built on this machine from source distributions (pyspark has no wheel on PyPI):
# their file bytes carry build timestamps, so their contents are hashed instead.
BUILT_HERE = ("shardq-", "pyspark-")


def download_spark_wheels(directory: Path) -> list[Path]:
    """shardq's wheel and every wheel `shardq[spark]` needs, for the image's Python.

    `pip wheel` builds pyspark's wheel from its source distribution (or takes it from
    pip's cache); the host's Python and glibc must therefore match the image's."""
    if sys.version_info[:2] != (3, 11):
        raise RuntimeError(f"the Spark image's wheels are made with Python 3.11 (the image's), not {sys.version}")
    directory.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(directory)]
    subprocess.run([*pip, "--no-deps", str(REPO_ROOT)], check=True)
    (shardq_wheel,) = directory.glob("shardq-*.whl")
    extras = PIP_REQUIREMENT_SPARK[PIP_REQUIREMENT_SPARK.index("[") :]
    subprocess.run([*pip, "--prefer-binary", f"{shardq_wheel}{extras}"], check=True)
    return sorted(directory.glob("*.whl"))


def spark_image_hash(wheels: list[Path]) -> str:
    digest = hashlib.sha256(f"spark recipe {RECIPE} {' '.join(DEBIAN_PACKAGES_SPARK)} {SPARK_ENV}\n".encode())
    for source in (ENTRYPOINT_SOURCE, JOB_SOURCE):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    for wheel in sorted(wheels, key=lambda path: path.name):
        if wheel.name.startswith("shardq-"):
            digest.update(f"shardq {_shardq_wheel_hash(wheel)}\n".encode())
        elif wheel.name.startswith(BUILT_HERE):
            digest.update(f"{wheel.name.split('-')[0]} {wheel_contents_hash(wheel)}\n".encode())
        else:
            digest.update(f"{wheel.name} {hashlib.sha256(wheel.read_bytes()).hexdigest()}\n".encode())
    return digest.hexdigest()[:16]


def _shardq_wheel_hash(wheel: Path) -> str:
    """The shardq wheel's contents without its long description: the README is the body
    of METADATA, and an edit to it changes nothing the image runs (1.4 GB rebuilt and
    imported otherwise)."""
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive:
        for name in sorted(archive.namelist()):
            if name.endswith("/RECORD"):
                continue
            data = archive.read(name)
            if name.endswith(".dist-info/METADATA"):
                data = data.split(b"\n\n", 1)[0]  # the headers: name, version, requirements
            digest.update(name.encode() + b"\0" + data)
    return digest.hexdigest()


def _chroot(rootfs: Path, *command: str) -> None:
    subprocess.run(
        ["chroot", str(rootfs), *command],
        check=True,
        env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"},
    )


def build_spark_image() -> Image:
    with tempfile.TemporaryDirectory(prefix="shardq-spark-wheels-") as scratch:
        wheels = download_spark_wheels(Path(scratch) / "wheels")
        tag = spark_image_hash(wheels)
        name = f"{REPOSITORY}:{tag}"
        # Not "shardq-*": e2e.images removes those when the server image changes.
        archive = images_dir() / f"spark-{tag}.tar"
        image = Image(name, archive)
        if archive.exists() and image.wheel_manifest.exists():
            log(f"{name}: unchanged, reusing {archive}")
            return image
        base = base_rootfs(DEBIAN_PACKAGES_SPARK)
        rootfs = Path(scratch) / "rootfs"
        log(f"{name}: installing {len(wheels)} wheels into a copy of {base.name}")
        subprocess.run(["cp", "-a", str(base), str(rootfs)], check=True)
        (rootfs / ".complete").unlink()
        inside = rootfs / WHEELS_IN_IMAGE.lstrip("/")
        shutil.copytree(wheels[0].parent, inside)
        (shardq_wheel,) = inside.glob("shardq-*.whl")
        extras = PIP_REQUIREMENT_SPARK[PIP_REQUIREMENT_SPARK.index("[") :]
        _chroot(
            rootfs,
            "python3",
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-cache-dir",
            "--break-system-packages",
            "--no-index",
            "--find-links",
            WHEELS_IN_IMAGE,
            f"{WHEELS_IN_IMAGE}/{shardq_wheel.name}{extras}",
        )
        shutil.rmtree(inside)
        for source, target in ((ENTRYPOINT_SOURCE, ENTRYPOINT), (JOB_SOURCE, JOB_FILE)):
            placed = rootfs / target.lstrip("/")
            placed.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, placed)
            placed.chmod(0o755 if source == ENTRYPOINT_SOURCE else 0o644)
        _chroot(
            rootfs,
            "useradd",
            "--uid",
            str(SPARK_UID),
            "--gid",
            "0",
            "--no-create-home",
            "--home-dir",
            WORK_DIR,
            "spark",
        )
        work_dir = rootfs / WORK_DIR.lstrip("/")
        work_dir.mkdir(parents=True)
        shutil.chown(work_dir, SPARK_UID, 0)
        log(f"{name}: packing")
        pack_image(
            rootfs,
            name,
            archive,
            entrypoint=[ENTRYPOINT],
            env=SPARK_ENV,
            user=str(SPARK_UID),
            working_dir=WORK_DIR,
        )
        image.wheel_manifest.write_text("".join(sorted(f"{wheel_requirement(w)}\n" for w in wheels)))
        for old in images_dir().glob("spark-*"):
            if old not in (archive, image.wheel_manifest):
                old.unlink()
        return image


def ensure_imported(layout: Layout, image: Image) -> float:
    """Import `image` into the real node's containerd unless it is there; returns the seconds taken."""
    started = time.monotonic()
    present = run(*_ctr(layout), "images", "ls", "-q", check=False, quiet=True).stdout.split()
    if image.name not in present:
        _import_images(layout, (image,))
    # Earlier builds are of no use any more (about 1.4 GB each in containerd).
    for old in present:
        if old.startswith(f"{REPOSITORY}:") and old != image.name:
            run(*_ctr(layout), "images", "rm", old, check=False, quiet=True)
    return time.monotonic() - started


def write_docker_context(directory: Path) -> None:
    """A `docker build` context for e2e/image/spark/Dockerfile with the same wheel set."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(directory / "wheels", ignore_errors=True)
    download_spark_wheels(directory / "wheels")
    for source in (DOCKERFILE, ENTRYPOINT_SOURCE, JOB_SOURCE):
        shutil.copy(source, directory / source.name)


def main() -> None:
    parser = argparse.ArgumentParser(description="Build (or reuse) the Spark image; print its name and archive.")
    parser.add_argument("--context", type=Path, help="instead, write a `docker build` context for the Dockerfile here")
    arguments = parser.parse_args()
    if arguments.context is not None:
        write_docker_context(arguments.context)
        print(f"docker build -t shardq-spark:dev {arguments.context}")
        return
    image = build_spark_image()
    print(f"{image.name} {image.archive}")


if __name__ == "__main__":
    main()
