# syntax=docker/dockerfile:1.7
# The tidegate gateway image. Build (needs a Docker engine):
#   docker build --build-arg GIT_SHA="$(git rev-parse --short HEAD)" -t tidegate:local .
# The image starts `tidegate serve --config /etc/tidegate/tidegate.yaml`. The config baked in
# there is deploy/tidegate.production.yaml, which refuses to start until its secret files are
# mounted (see docs/deploy.md): a misconfigured deploy fails at start-up, not on the first request.

# Stage 1: a virtualenv with the locked dependencies, then tidegate itself.
FROM python:3.11.13-slim-bookworm AS builder

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /build

# The dependency layer is cached until pyproject.toml or requirements.lock changes, so editing
# the code rebuilds only the small layer below it.
COPY pyproject.toml requirements.lock ./
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --require-virtualenv -r requirements.lock

COPY README.md LICENSE ./
COPY src ./src
# --no-deps: every dependency is already installed, at the locked version.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --require-virtualenv --no-deps . \
    && pip check

# Stage 2: the virtualenv and a non-root user; no compilers, no tests, no source tree.
FROM python:3.11.13-slim-bookworm

# A fixed numeric uid/gid, so Kubernetes' runAsNonRoot can verify it without a name lookup.
RUN groupadd --system --gid 10001 tidegate \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/tidegate --create-home \
       --shell /usr/sbin/nologin tidegate

COPY --from=builder /opt/venv /opt/venv
COPY deploy/tidegate.production.yaml /etc/tidegate/tidegate.yaml

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# The build's git sha, served at GET /version: "which build answered this?" in one request.
ARG GIT_SHA=unknown
ENV TIDEGATE_GIT_SHA=${GIT_SHA}
LABEL org.opencontainers.image.title="tidegate" \
      org.opencontainers.image.revision="${GIT_SHA}" \
      org.opencontainers.image.licenses="Apache-2.0"

WORKDIR /var/lib/tidegate
USER 10001:10001
EXPOSE 8080

# Liveness only: /healthz touches no dependency, so a database blip never restarts the process.
# There is no curl in the slim image; Python's urllib does the request.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"]

# On SIGTERM the server stops accepting, lets in-flight requests and streams finish for
# server.drain_seconds, then exits; the orchestrator's grace period must be longer than that.
STOPSIGNAL SIGTERM
CMD ["tidegate", "serve", "--config", "/etc/tidegate/tidegate.yaml"]
