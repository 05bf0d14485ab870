"""Container images for the real node, built without Docker and without a registry.

- `localhost/pause:shardq`: the pod sandbox, a 20-line static Go program.
- `localhost/shardq:<hash>`: Debian bookworm (debootstrap --variant=minbase, python3)
  with shardq and its server and operator dependencies installed from wheels downloaded on the
  host; pip inside the chroot cannot reach the package index here. The tag is the
  content hash of the wheel set and this recipe, so an unchanged image is reused.

Images are packed as docker-archive tars (manifest.json, config, one layer) that
`ctr images import` accepts, and cached in ${XDG_CACHE_HOME:-~/.cache}/shardq/images.
The same image is described by e2e/image/Dockerfile for users with Docker; both
install DEBIAN_PACKAGES and the wheel set of `PIP_REQUIREMENT` (a test checks it).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from e2e.binaries import cache_root

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = Path(__file__).parent / "image" / "Dockerfile"
PAUSE_SOURCE = Path(__file__).parent / "image" / "pause" / "main.go"
# Bumped when the way an image is built changes, so cached images are redone.
RECIPE = "1"
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# What the image's root file system holds besides minbase; the Dockerfile installs the same.
DEBIAN_PACKAGES = ("python3", "python3-pip", "tini")
# What pip installs into it: shardq with the server's and the operator's dependencies (one image runs both).
PIP_REQUIREMENT = "shardq[server,operator]"
PAUSE_IMAGE = "localhost/pause:shardq"
# Where the wheels sit inside the image's root while pip installs them (removed after).
WHEELS_IN_IMAGE = "/tmp/wheels"
SHARDQ_REPOSITORY = "localhost/shardq"


def log(message: str) -> None:
    print(f"[images {datetime.datetime.now():%H:%M:%S}] {message}", file=sys.stderr, flush=True)


def images_dir() -> Path:
    directory = cache_root() / "images"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@dataclass(frozen=True)
class Image:
    name: str  # repository:tag
    archive: Path  # docker-archive tar for `ctr images import`

    @property
    def wheel_manifest(self) -> Path:
        """`name==version` of every wheel installed into the image (shardq images only)."""
        return self.archive.with_suffix(".wheels.txt")


def wheel_requirement(wheel: Path) -> str:
    """`name==version` of a wheel file, names normalised as pip lists them."""
    name, version = wheel.name.split("-")[:2]
    return f"{name.replace('_', '-').lower()}=={version}"


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        for block in iter(lambda: source.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pack_image(
    rootfs: Path,
    name: str,
    archive: Path,
    *,
    entrypoint: list[str],
    cmd: list[str] | None = None,
    env: tuple[str, ...] = (),
    user: str = "",
    working_dir: str = "/",
) -> None:
    """Write `rootfs` as a one-layer docker-archive tar tagged `name`; `env` adds
    `KEY=value` entries to the image's environment."""
    tmp = archive.with_suffix(".partial")
    layer = tmp.with_suffix(".layer")
    with tarfile.open(layer, "w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(rootfs.iterdir()):
            tar.add(entry, arcname=entry.name, recursive=True)
    diff_id = "sha256:" + _sha256_file(layer)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {
            "Entrypoint": entrypoint,
            "Cmd": cmd,
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONUNBUFFERED=1", *env],
            "WorkingDir": working_dir,
            **({"User": user} if user else {}),
        },
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    manifest = [{"Config": config_name, "RepoTags": [name], "Layers": ["layer.tar"]}]
    with tarfile.open(tmp, "w") as tar:

        def add_bytes(member: str, data: bytes) -> None:
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        add_bytes(config_name, config_bytes)
        add_bytes("manifest.json", json.dumps(manifest).encode())
        tar.add(layer, arcname="layer.tar")
    layer.unlink()
    os.replace(tmp, archive)


def build_pause_image() -> Image:
    archive = images_dir() / f"pause-{RECIPE}-{_sha256_file(PAUSE_SOURCE)[:12]}.tar"
    if archive.exists():
        return Image(PAUSE_IMAGE, archive)
    log("building the pause image (static Go binary)")
    with tempfile.TemporaryDirectory(prefix="shardq-pause-") as work:
        root = Path(work) / "root"
        root.mkdir()
        module = Path(work) / "src"
        module.mkdir()
        shutil.copy(PAUSE_SOURCE, module / "main.go")
        (module / "go.mod").write_text("module shardq.local/pause\n\ngo 1.22\n")
        environment = {
            **os.environ,
            "CGO_ENABLED": "0",
            "GOTOOLCHAIN": "local",
            "GOFLAGS": "-mod=mod",
            "GOWORK": "off",
            "GOCACHE": str(cache_root() / "go" / "build"),
            "GOMODCACHE": str(cache_root() / "go" / "mod"),
        }
        subprocess.run(
            ["go", "build", "-trimpath", "-ldflags", "-s -w", "-o", str(root / "pause"), "."],
            cwd=module,
            env=environment,
            check=True,
        )
        pack_image(root, PAUSE_IMAGE, archive, entrypoint=["/pause"])
    return Image(PAUSE_IMAGE, archive)


def base_rootfs(packages: tuple[str, ...] = DEBIAN_PACKAGES) -> Path:
    """Debian minbase with `packages`, built once per package set (debootstrap, about 90 s)."""
    key = hashlib.sha256(f"{RECIPE} {DEBIAN_SUITE} {' '.join(packages)}".encode()).hexdigest()[:12]
    rootfs = images_dir() / f"base-{DEBIAN_SUITE}-{key}"
    if (rootfs / ".complete").exists():
        return rootfs
    if shutil.which("debootstrap") is None:
        raise RuntimeError("debootstrap is not installed (apt-get install debootstrap)")
    partial = rootfs.with_name(rootfs.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    log(f"debootstrap {DEBIAN_SUITE} minbase + {', '.join(packages)} (about 90 s)")
    subprocess.run(
        [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(packages)}",
            DEBIAN_SUITE,
            str(partial),
            DEBIAN_MIRROR,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    # Package caches and lists are not needed at run time (about 90 MB).
    for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for path in (partial / leftover).glob("*"):
            if path.is_file():
                path.unlink()
    (partial / ".complete").write_text(key)
    shutil.rmtree(rootfs, ignore_errors=True)
    os.replace(partial, rootfs)
    return rootfs


def download_wheels(directory: Path) -> list[Path]:
    """shardq's wheel and every dependency's, for the image's Python (3.11, manylinux x86_64)."""
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(directory), str(REPO_ROOT)],
        check=True,
    )
    (shardq_wheel,) = directory.glob("shardq-*.whl")
    extras = PIP_REQUIREMENT[PIP_REQUIREMENT.index("[") :]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--only-binary=:all:",
            "--python-version=3.11",
            "--implementation=cp",
            "--platform=manylinux2014_x86_64",
            "--platform=manylinux_2_17_x86_64",
            "--platform=manylinux_2_28_x86_64",
            "--dest",
            str(directory),
            f"{shardq_wheel}{extras}",
        ],
        check=True,
    )
    return sorted(directory.glob("*.whl"))


def wheel_set_hash(wheels: list[Path]) -> str:
    digest = hashlib.sha256(f"recipe {RECIPE} {' '.join(DEBIAN_PACKAGES)}\n".encode())
    for wheel in sorted(wheels, key=lambda path: path.name):
        if wheel.name.startswith("shardq-"):
            # A freshly built wheel differs in timestamps only: hash its contents.
            digest.update(b"shardq " + wheel_contents_hash(wheel).encode())
        else:
            digest.update(f"{wheel.name} {_sha256_file(wheel)}\n".encode())
    return digest.hexdigest()[:16]


def wheel_contents_hash(wheel: Path) -> str:
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive:
        for name in sorted(archive.namelist()):
            if name.endswith("/RECORD"):
                continue
            digest.update(name.encode() + b"\0" + archive.read(name))
    return digest.hexdigest()


def build_shardq_image() -> Image:
    with tempfile.TemporaryDirectory(prefix="shardq-wheels-") as scratch:
        wheels = download_wheels(Path(scratch) / "wheels")
        tag = wheel_set_hash(wheels)
        name = f"{SHARDQ_REPOSITORY}:{tag}"
        archive = images_dir() / f"shardq-{tag}.tar"
        image = Image(name, archive)
        if archive.exists() and image.wheel_manifest.exists():
            log(f"{name}: unchanged, reusing {archive}")
            return image
        base = base_rootfs()
        rootfs = Path(scratch) / "rootfs"
        log(f"{name}: installing {len(wheels)} wheels into a copy of {base.name}")
        subprocess.run(["cp", "-a", str(base), str(rootfs)], check=True)
        (rootfs / ".complete").unlink()
        inside = rootfs / WHEELS_IN_IMAGE.lstrip("/")
        shutil.copytree(wheels[0].parent, inside)
        (shardq_wheel,) = inside.glob("shardq-*.whl")
        extras = PIP_REQUIREMENT[PIP_REQUIREMENT.index("[") :]
        subprocess.run(
            [
                "chroot",
                str(rootfs),
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
            ],
            check=True,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"},
        )
        shutil.rmtree(inside)
        log(f"{name}: packing")
        pack_image(rootfs, name, archive, entrypoint=["/usr/bin/tini", "--"], cmd=["shardq", "--help"])
        image.wheel_manifest.write_text("".join(sorted(f"{wheel_requirement(w)}\n" for w in wheels)))
        # Older images of this recipe are of no use any more.
        for old in images_dir().glob("shardq-*"):
            if old not in (archive, image.wheel_manifest):
                old.unlink()
        return image


def write_docker_context(directory: Path) -> None:
    """A `docker build` context for e2e/image/Dockerfile with the same wheel set."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(directory / "wheels", ignore_errors=True)
    download_wheels(directory / "wheels")
    shutil.copy(DOCKERFILE, directory / "Dockerfile")


def main() -> None:
    parser = argparse.ArgumentParser(description="Build (or reuse) the real node's images; print their names.")
    parser.add_argument("--context", type=Path, help="instead, write a `docker build` context for the Dockerfile here")
    arguments = parser.parse_args()
    if arguments.context is not None:
        write_docker_context(arguments.context)
        print(f"docker build -t shardq:dev {arguments.context}")
        return
    for image in (build_pause_image(), build_shardq_image()):
        print(f"{image.name} {image.archive}")


if __name__ == "__main__":
    main()
