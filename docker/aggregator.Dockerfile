# syntax=docker/dockerfile:1.7
# The secure aggregator: base dependencies only (numpy, scipy, cryptography, pynacl, grpc), no torch.
#   make images        (or: podman build --build-arg BASE=... -f docker/aggregator.Dockerfile .)
# BASE: a Debian bookworm with python3, python3-venv and tini; `make images` builds one offline
# (debootstrap). Packages come from build/wheelhouse (`make images` fills it on the host), so the
# build needs no network.
ARG BASE=localhost/tally-base:bookworm
# checkov:skip=CKV_DOCKER_7: the base is this build argument, whose default is tagged (bookworm)

FROM ${BASE} AS build
# Marks what `make images` may prune once this stage is no longer needed, and nothing else.
LABEL org.tally.built-by="docker/build-images.sh"
COPY build/wheelhouse /wheels
RUN python3 -m venv /opt/tally \
    && /opt/tally/bin/pip install --no-cache-dir --no-index --find-links /wheels "tally[aggregator]" \
    && /opt/tally/bin/pip uninstall --yes pip setuptools

FROM ${BASE}
ARG BASE
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="tally-aggregator" \
      org.tally.built-by="docker/build-images.sh" \
      org.opencontainers.image.description="Tally secure aggregator: secure-sum sessions for cohorts, cohort sums only" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="${BASE}"
RUN groupadd --gid 10001 tally \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tally
COPY --from=build /opt/tally /opt/tally
ENV PATH=/opt/tally/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001:10001
# 7001: devices (SecureAggregation); 7002: the coordinator (AggregatorControl);
# 9465: /metrics, /healthz, /readyz.
EXPOSE 7001 7002 9465
# The device port demands no client certificate (--require-client-cert holds on the control port
# only; devices are authenticated by the Join in each stream): the probe checks the server
# against the CA in the aggregator's own TLS directory.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
    CMD ["tally-probe", "127.0.0.1:7001", "--tls-dir", "/etc/tally/tls"]
# tini is PID 1: it forwards SIGTERM to the aggregator and reaps what probes leave behind.
ENTRYPOINT ["tini", "--", "tally-aggregator"]
CMD ["--listen", "0.0.0.0:7001", "--control-listen", "0.0.0.0:7002", "--id", "aggregator-0", \
     "--tls-dir", "/etc/tally/tls", "--require-client-cert", \
     "--metrics-addr", "0.0.0.0", "--metrics-port", "9465"]
