# The kubeinfer operator (`kubeinfer operator run`). Build from the repository root:
#
#   docker build -f docker/operator.Dockerfile -t kubeinfer/operator:0.1.0 .
#
# The chart (helm/kubeinfer) runs it as user 1000 with a read-only root filesystem, HOME in a
# /tmp emptyDir and settings as KUBEINFER_OPERATOR_* env. The `helm test` pod uses this image
# too (python + the kubernetes client).
FROM python:3.12-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp

WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kubeinfer/ kubeinfer/
COPY runtime/ runtime/
COPY kernels/ kernels/
COPY operator/ operator/
COPY router/ router/
COPY devcluster/ devcluster/
# The core distribution alone: the operator never imports torch, and only the `runtime` extra
# (the runtime image) brings it.
RUN pip install . \
    && rm -rf /src

RUN groupadd --gid 1000 kubeinfer && useradd --uid 1000 --gid 1000 --no-create-home \
    --shell /usr/sbin/nologin kubeinfer
USER 1000:1000
WORKDIR /tmp
EXPOSE 8080 9090
ENTRYPOINT ["kubeinfer", "operator", "run"]
