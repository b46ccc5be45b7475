"""The image's Dockerfile: hadolint finds nothing, and it builds what a GPU node
needs (a CUDA base, the project's torch pin, the nixl extra, RDMA userspace).

No container engine or image registry is reachable where the tests run, so
the image itself is not built here (docs/kubernetes.md says how to build it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
HADOLINT = Path(sys.executable).with_name("hadolint")


def test_hadolint_finds_nothing() -> None:
    run = subprocess.run(
        [str(HADOLINT), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout + run.stderr
    # Every rule it is told to ignore says why, on the line above.
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("# hadolint ignore="):
            assert lines[i - 1].startswith("#") and len(lines[i - 1]) > 10, line


def test_the_image_has_what_a_gpu_node_needs() -> None:
    text = DOCKERFILE.read_text()
    base = re.search(r"^ARG CUDA_IMAGE=(\S+)$", text, re.M)
    # Fully qualified: buildah and podman refuse short names without a registries list.
    assert base is not None and base.group(1).startswith("docker.io/nvidia/cuda:")
    assert "-runtime-" in base.group(1)
    assert "pip install '.[nixl]'" in text  # torch at pyproject's pin, with NIXL/UCX
    for package in ("libibverbs1", "ibverbs-providers", "librdmacm1", "rdma-core"):
        assert package in text
    assert "USER 10001:10001" in text  # the pods' runAsUser
