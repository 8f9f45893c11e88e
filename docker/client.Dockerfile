# syntax=docker/dockerfile:1.7
# Devices: `tally-client` (one device) and `tally-fleet` (simulated devices for load tests).
#   docker build -f docker/client.Dockerfile -t tally-client:0.1.0 .

FROM python:3.11.14-slim-bookworm AS build
# PyPI's torch wheel for Linux carries CUDA (gigabytes); the CPU build comes from PyTorch's index.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY tally ./tally
COPY coordinator ./coordinator
COPY aggregator ./aggregator
COPY client_sdk ./client_sdk
RUN python -m venv /opt/tally \
    && /opt/tally/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch==2.13.0 \
    && /opt/tally/bin/pip install --no-cache-dir -c constraints.txt ".[client]" \
    && /opt/tally/bin/pip uninstall --yes pip setuptools

FROM python:3.11.14-slim-bookworm
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="tally-client" \
      org.opencontainers.image.description="Tally devices: one device (tally-client) or a simulated fleet (tally-fleet)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11.14-slim-bookworm"
RUN python -m pip uninstall --yes pip setuptools wheel \
    && groupadd --system --gid 10001 tally \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tally
COPY --from=build /opt/tally /opt/tally
ENV PATH=/opt/tally/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    TALLY_COORDINATOR=tally-coordinator:7000
USER 10001:10001
# 9466: the fleet's /metrics, /healthz and /readyz. A device serves no gRPC of its own: its
# health is whether the coordinator it works for answers, over the TLS it uses.
EXPOSE 9466
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["sh", "-c", "exec tally-probe \"$TALLY_COORDINATOR\" --tls-dir /etc/tally/tls"]
ENTRYPOINT ["tally-fleet"]
CMD ["--coordinator", "tally-coordinator:7000", "--devices", "10", "--tls-dir", "/etc/tally/tls", \
     "--no-progress", "--metrics-addr", "0.0.0.0", "--metrics-port", "9466"]
