# The kubeinfer runtime (`kubeinfer serve`) on CUDA. Build from the repository root:
#
#   docker build -f docker/runtime.Dockerfile -t kubeinfer/runtime:0.1.0 .
#
# The operator renders the runtime pods (operator/manifests.py): command `kubeinfer serve`,
# user 1000, a read-only root filesystem with HOME and caches in the /tmp emptyDir, the model
# mounted read-only under /models, /dev/shm an in-memory emptyDir.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VIRTUAL_ENV=/opt/kubeinfer \
    PATH=/opt/kubeinfer/bin:$PATH \
    HOME=/tmp

# Triton compiles a small launcher per kernel at run time: it needs a C compiler and Python.h;
# the C++ CPU kernels build with the same compiler; `kubeinfer serve` preloads tcmalloc on CPU.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
       libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV"

WORKDIR /src
# Metadata first, so that a code-only change reuses the (several-GB) dependency layer.
COPY pyproject.toml setup.py README.md ./
COPY kubeinfer/ kubeinfer/
COPY runtime/ runtime/
COPY kernels/ kernels/
COPY operator/ operator/
COPY router/ router/
COPY devcluster/ devcluster/
# The gpu extra: Triton for the kernels (torch from PyPI is the CUDA build).
RUN pip install --upgrade pip "setuptools>=69" wheel \
    && pip install ".[runtime,gpu]" \
    && rm -rf /src

# The pods run as uid/gid 1000 (runAsNonRoot needs a number); Ubuntu 24.04 images already
# have that user (ubuntu), so no new one is made.
USER 1000:1000
WORKDIR /tmp
EXPOSE 8000
ENTRYPOINT ["kubeinfer", "serve"]
CMD ["--help"]
