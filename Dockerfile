# One image runs the operator and every pod of a PDCluster (router, prefill,
# decode): `pdcluster worker|router ...` for the pods, `pdcluster fetch-model`
# for an hf:// model's download, and `python -m pdcluster.operator` for the
# operator (the Helm chart's command).
#
# Built for GPU nodes: a CUDA runtime base, torch at the project's pin (PyPI's
# Linux wheel carries its CUDA libraries), the `nixl` extra (NIXL with its
# UCX), and the RDMA userspace UCX loads to use InfiniBand or RoCE
# (libibverbs and the providers, librdmacm). The GPU driver comes from the
# node (NVIDIA container toolkit), the RDMA devices from the cluster's RDMA
# device plugin. CPU-only nodes run the same image.
#
#   docker build -t registry.example.com/pdcluster:0.1.0 .      # or: buildah bud -t ...
#   docker push registry.example.com/pdcluster:0.1.0
# (docs/kubernetes.md, "Build and push the image").
ARG CUDA_IMAGE=docker.io/nvidia/cuda:12.9.1-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Distribution packages follow the base image's release (no per-package pins).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /tmp/build
COPY pyproject.toml setup.py README.md ./
COPY runtime ./runtime
COPY operator ./operator
# The versions are the project's pins (pyproject.toml): torch, nixl and the rest.
# hadolint ignore=DL3013
RUN python3 -m venv /opt/pdcluster \
    && /opt/pdcluster/bin/pip install --upgrade pip \
    && /opt/pdcluster/bin/pip install '.[nixl]'

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/pdcluster/bin:${PATH}
# RDMA userspace for UCX (verbs, the mlx5/efa/... providers, the connection
# manager); numactl for pinning on multi-socket nodes.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 libibverbs1 ibverbs-providers librdmacm1 rdma-core numactl ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/pdcluster /opt/pdcluster

# The chart runs the operator, and the operator every PDCluster pod, as this
# user (runAsNonRoot, read-only root file system; HOME points into /tmp).
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin pdcluster
USER 10001:10001
WORKDIR /

ENTRYPOINT ["pdcluster"]
CMD ["--help"]
