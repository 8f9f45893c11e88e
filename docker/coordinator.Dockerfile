# syntax=docker/dockerfile:1.7
# The coordinator: jobs, rounds, checkpoints; torch (CPU build) for model definitions and ONNX.
#   docker build -f docker/coordinator.Dockerfile -t tally-coordinator:0.1.0 .

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
    && /opt/tally/bin/pip install --no-cache-dir -c constraints.txt ".[coordinator]" \
    && /opt/tally/bin/pip uninstall --yes pip setuptools

FROM python:3.11.14-slim-bookworm
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="tally-coordinator" \
      org.opencontainers.image.description="Tally coordinator: jobs, rounds, cohorts, the algorithms' server halves on cohort sums" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11.14-slim-bookworm"
RUN python -m pip uninstall --yes pip setuptools wheel \
    && groupadd --system --gid 10001 tally \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tally \
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
ENTRYPOINT ["tally-coordinator"]
CMD ["--listen", "0.0.0.0:7000", "--state-dir", "/var/lib/tally", "--tls-dir", "/etc/tally/tls", \
     "--metrics-addr", "0.0.0.0", "--metrics-port", "9464"]
