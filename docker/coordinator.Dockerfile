# syntax=docker/dockerfile:1.7
# The coordinator: jobs, rounds, checkpoints; torch (CPU build) for model definitions and ONNX.
#   make images        (or: podman build --build-arg BASE=... -f docker/coordinator.Dockerfile .)
# BASE: a Debian bookworm with python3, python3-venv and tini; `make images` builds one offline
# (debootstrap). Packages come from build/wheelhouse (`make images` fills it on the host: torch
# is the CPU build), so the build needs no network.
ARG BASE=localhost/tally-base:bookworm
# checkov:skip=CKV_DOCKER_7: the base is this build argument, whose default is tagged (bookworm)

FROM ${BASE} AS build
# Marks what `make images` may prune once this stage is no longer needed, and nothing else.
LABEL org.tally.built-by="docker/build-images.sh"
COPY build/wheelhouse /wheels
# PACKAGES: the algorithm packages (distribution names, space-separated) to install beside tally,
# from wheels `make images` put in the wheelhouse (PACKAGES=path/to/package ...): what a coordinator
# and its devices can run. Devices never download code, so an image runs only what it was built with.
ARG PACKAGES=""
# hadolint ignore=SC2086
RUN python3 -m venv /opt/tally \
    && /opt/tally/bin/pip install --no-cache-dir --no-index --find-links /wheels "tally[coordinator]" $PACKAGES \
    && /opt/tally/bin/pip uninstall --yes pip setuptools

FROM ${BASE}
ARG BASE
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="tally-coordinator" \
      org.tally.built-by="docker/build-images.sh" \
      org.opencontainers.image.description="Tally coordinator: jobs, rounds, cohorts, the algorithms' server halves on cohort sums" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="${BASE}"
RUN groupadd --gid 10001 tally \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tally \
    && mkdir -p /var/lib/tally \
    && chown 10001:10001 /var/lib/tally
COPY --from=build /opt/tally /opt/tally
ENV PATH=/opt/tally/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001:10001
VOLUME ["/var/lib/tally"]
# 7000: devices and operators (gRPC); 9464: /metrics, /healthz, /readyz.
EXPOSE 7000 9464
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["tally-probe", "127.0.0.1:7000", "--tls-dir", "/etc/tally/tls"]
# tini is PID 1: it forwards SIGTERM and reaps what probes leave behind.
ENTRYPOINT ["tini", "--", "tally-coordinator"]
CMD ["--listen", "0.0.0.0:7000", "--state-dir", "/var/lib/tally", "--tls-dir", "/etc/tally/tls", \
     "--metrics-addr", "0.0.0.0", "--metrics-port", "9464"]
