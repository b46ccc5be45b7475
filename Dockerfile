# One image runs the operator and every pod of a PDCluster (router, prefill,
# decode): `pdcluster worker|router ...` for the pods, and
# `python -m pdcluster.operator` for the operator (the Helm chart's command).
#
# Not built by CI or in the development sandbox (no container runtime there);
# kept minimal so it can be checked by reading:
#   docker build -t pdcluster:0.1.0 .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /tmp/build
COPY pyproject.toml setup.py README.md ./
COPY runtime ./runtime
COPY operator ./operator
RUN pip install '.[nixl]' && cd / && rm -rf /tmp/build

# The chart runs the operator, and the operator every PDCluster pod, as this
# user (runAsNonRoot, read-only root file system).
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin pdcluster
USER 10001:10001
WORKDIR /

ENTRYPOINT ["pdcluster"]
CMD ["--help"]
