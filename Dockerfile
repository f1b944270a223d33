# syntax=docker/dockerfile:1
# The image the chart names (values.yaml image.repository, tag = the chart's appVersion): the
# wavepp package and its one console script. The operator and every pipeline pod run
# `wavepp <subcommand>` (the chart's and the operator's `command: [wavepp]`) as the non-root user
# 65532:65532 their pod security contexts require, with a read-only root filesystem (HOME and
# TMPDIR are /tmp, an emptyDir in the pods).
#
#   CPU:   docker build -t ghcr.io/wavepp/wavepp:0.1.0 .
#   CUDA:  docker build --build-arg TORCH_VARIANT=cu126 -t ghcr.io/wavepp/wavepp:0.1.0-cuda .
#
# TORCH_VARIANT picks the PyTorch wheel index (cpu, or a CUDA build such as cu126): the CUDA
# wheels carry their CUDA runtime, the node's driver comes from the NVIDIA container toolkit.
# Checked by tests/operator/test_dockerfile.py (user and entrypoint vs. the chart and the
# operator) and hadolint; see docs/operator.md.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_VARIANT=cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/wavepp
ENV PATH=/opt/wavepp/bin:$PATH
COPY pyproject.toml README.md ./
COPY wavepp ./wavepp
# torch first, from the variant's index, at the version pyproject.toml pins; then the package.
# DL3013: the package is this checkout (a path) and torch is pinned through TORCH_REQ.
# hadolint ignore=DL3013
RUN TORCH_REQ="$(python -c 'import tomllib; d = tomllib.load(open("pyproject.toml", "rb")); print(next(x for x in d["project"]["dependencies"] if x.startswith("torch")))')" \
 && pip install --no-cache-dir --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" "${TORCH_REQ}" \
 && pip install --no-cache-dir /src

FROM python:${PYTHON_VERSION}-slim
ARG TORCH_VARIANT=cpu
LABEL org.opencontainers.image.title="wavepp" \
      org.opencontainers.image.source="https://github.com/wavepp/wavepp" \
      org.opencontainers.image.description="WavePP: pipeline-parallel LLM prefill and its operator" \
      dev.wavepp.torch-variant="${TORCH_VARIANT}"
RUN groupadd --system --gid 65532 wavepp \
 && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin wavepp
COPY --from=build /opt/wavepp /opt/wavepp
ENV PATH=/opt/wavepp/bin:$PATH HOME=/tmp TMPDIR=/tmp PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /tmp
USER 65532:65532
ENTRYPOINT ["wavepp"]
CMD ["--help"]
