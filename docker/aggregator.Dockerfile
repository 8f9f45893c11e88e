# syntax=docker/dockerfile:1.7
# The secure aggregator: base dependencies only (numpy, scipy, cryptography, grpc), no torch.
#   docker build -f docker/aggregator.Dockerfile -t tally-aggregator:0.1.0 .

FROM python:3.11.14-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY tally ./tally
COPY coordinator ./coordinator
COPY aggregator ./aggregator
COPY client_sdk ./client_sdk
RUN python -m venv /opt/tally \
    && /opt/tally/bin/pip install --no-cache-dir -c constraints.txt ".[aggregator]" \
    && /opt/tally/bin/pip uninstall --yes pip setuptools

FROM python:3.11.14-slim-bookworm
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="tally-aggregator" \
      org.opencontainers.image.description="Tally secure aggregator: secure-sum sessions for cohorts, cohort sums only" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11.14-slim-bookworm"
# No build tools in the image: the base's pip, setuptools and wheel go; the venv was built above.
RUN python -m pip uninstall --yes pip setuptools wheel \
    && groupadd --system --gid 10001 tally \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tally
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
ENTRYPOINT ["tally-aggregator"]
CMD ["--listen", "0.0.0.0:7001", "--control-listen", "0.0.0.0:7002", "--id", "aggregator-0", \
     "--tls-dir", "/etc/tally/tls", "--require-client-cert", \
     "--metrics-addr", "0.0.0.0", "--metrics-port", "9465"]
