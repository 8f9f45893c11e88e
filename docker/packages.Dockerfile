# syntax=docker/dockerfile:1.7
# Algorithm and model packages added to a role image you already have (a release's, or `make
# images`'), without rebuilding it: one layer with the packages' wheels installed into its
# /opt/tally. The coordinator and the client images take the same packages at the same versions:
# devices never download code, so what the devices run is what their image was built with.
#
#   pip wheel --no-deps -w build/packages examples/algorithm-package
#   podman build -f docker/packages.Dockerfile --build-arg IMAGE=localhost/tally-coordinator:0.1.0 \
#       -t localhost/tally-coordinator:0.1.0-fedavgm build/packages
#
# The build context is a directory holding the wheels and nothing else; a package's dependencies
# beyond tally's must be among them (the image has no index to fetch from).
ARG IMAGE
# checkov:skip=CKV_DOCKER_7: the image is this build argument, tagged by whoever builds
# checkov:skip=CKV_DOCKER_2: the role image's HEALTHCHECK (and entrypoint, user, ports) carry over
FROM ${IMAGE}
# Marks what `make images` may prune once this layer is no longer needed, and nothing else.
LABEL org.tally.built-by="docker/build-images.sh"
USER 0:0
COPY *.whl /wheels/
# The role images carry no pip: a throwaway one, from the base's ensurepip, installs into
# /opt/tally with --python and leaves with the wheels.
RUN python3 -m venv /tmp/pip \
    && /tmp/pip/bin/pip --python /opt/tally/bin/python install --no-cache-dir --no-index --no-deps \
        --disable-pip-version-check /wheels/*.whl \
    && rm -rf /tmp/pip /wheels
USER 10001:10001
