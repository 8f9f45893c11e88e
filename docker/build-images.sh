#!/usr/bin/env bash
# `make images`: the three role images, built with podman on this machine and without a registry.
#
#   1. a base image (Debian bookworm minbase + python3, python3-venv, tini) from debootstrap, once;
#   2. a wheelhouse on the host (build/wheelhouse): the project's wheel and every dependency, torch
#      the CPU build pip finds locally, so the image builds install with --no-index;
#   3. one image per role: localhost/tally-{aggregator,coordinator,client}:VERSION;
#   4. with REGISTRY=host[:port]/prefix: pushed there and pinned by digest in the images component
#      (docker/push-images.sh).
#
# Runs as root (debootstrap and rootful podman). At the end it prunes the dangling images its own
# builds left (build stages, role images a rebuild replaced: both carry the org.tally.built-by
# label), and no other image on the host.
# Environment: BASE (an existing image to build on instead of the debootstrap one), PYTHON (the
# interpreter whose pip builds the wheelhouse; python3 by default), DEBIAN_MIRROR, PACKAGES (the
# source directories of algorithm packages to install in the coordinator and client images, e.g.
# PACKAGES=examples/algorithm-package: their wheels join the wheelhouse, their names the builds),
# TAG (the role images' tag; default: the version, so that images with packages can sit beside
# the plain ones: PACKAGES=... TAG=0.1.0-fedavgm).
# Podman runs with cgroupfs and runc and explicit ulimits: crun fails on this machine's hybrid
# cgroups, and without limits setrlimit(RLIMIT_NOFILE) is refused.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
BASE=${BASE:-localhost/tally-base:bookworm}
PYTHON=${PYTHON:-python3}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=${PACKAGES:-}
TAG=${TAG:-$VERSION}
PODMAN=(podman --cgroup-manager=cgroupfs)
RUNTIME=(--runtime /usr/sbin/runc --ulimit nofile=20000:20000 --ulimit nproc=4096:4096)

say() { printf '[images] %s\n' "$*" >&2; }

need_tools() {
    local missing=()
    for tool in podman runc debootstrap; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    [ ${#missing[@]} -eq 0 ] && return
    say "installing podman, runc and debootstrap (missing: ${missing[*]})"
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo -n"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
        podman runc debootstrap uidmap slirp4netns containernetworking-plugins iptables >/dev/null
}

build_base() {
    if "${PODMAN[@]}" image exists "$BASE"; then
        say "base $BASE: present"
        return
    fi
    [ "$BASE" = localhost/tally-base:bookworm ] || { say "base image $BASE is missing"; exit 1; }
    local root=build/base-rootfs
    say "base $BASE: debootstrap bookworm from $DEBIAN_MIRROR (a few minutes, once)"
    rm -rf "$root"
    mkdir -p "$(dirname "$root")"  # debootstrap resolves a relative target from its parent, which a fresh clone lacks
    debootstrap --variant=minbase --include=python3,python3-venv,tini bookworm "$root" "$DEBIAN_MIRROR" >/dev/null
    # What no container needs: package lists, documentation, man pages, locales, apt's caches.
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/usr/share/doc/* \
        "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/*
    tar -C "$root" -c . | "${PODMAN[@]}" import --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
    rm -rf "$root"
}

same_python() {
    # The wheelhouse is resolved for $PYTHON and installed with --no-index into the base's python3:
    # their versions must agree, or no wheel of a compiled dependency matches.
    local host base
    host=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    base=$("${PODMAN[@]}" run --rm "${RUNTIME[@]}" --pull=never --entrypoint python3 "$BASE" \
        -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [ "$host" = "$base" ] || { say "$PYTHON is Python $host but $BASE has $base: set PYTHON to a $base"; exit 1; }
}

build_wheelhouse() {
    say "wheelhouse: build/wheelhouse"
    # From scratch each time (pip's cache keeps it cheap): wheels left from other versions would
    # be preferred by the unconstrained --no-index install in the images.
    rm -rf build/wheelhouse
    mkdir -p build/wheelhouse
    # (pip's complaints about this machine's configured local indexes are noise here)
    "$PYTHON" -m pip wheel --quiet --disable-pip-version-check -c constraints.txt \
        --wheel-dir build/wheelhouse '.[coordinator,loadtest]' 2> >(grep -v 'is ignored: it is neither' >&2)
    local package copy
    for package in $PACKAGES; do  # their dependencies beyond tally's must be in the wheelhouse too
        # From a copy: setuptools builds in the source tree and would leave build/ there.
        copy=build/packages/$(basename "$package")
        rm -rf "$copy"
        mkdir -p build/packages
        cp -r "$package" "$copy"
        "$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps \
            --wheel-dir build/wheelhouse "$copy"
    done
}

# The distribution names of $PACKAGES, as the images' pip install takes them.
package_names() {
    local package names=()
    for package in $PACKAGES; do
        names+=("$(sed -n 's/^name = "\(.*\)"/\1/p' "$package/pyproject.toml" | head -1)")
    done
    echo "${names[*]}"
}

build_role() {
    local role=$1 image=localhost/tally-$1:$TAG
    say "image $image"
    "${PODMAN[@]}" build --quiet --format docker "${RUNTIME[@]}" --pull=never \
        --ignorefile "docker/$role.Dockerfile.dockerignore" \
        --build-arg BASE="$BASE" --build-arg VERSION="$VERSION" --build-arg PACKAGES="$(package_names)" \
        --build-arg REVISION="$(git rev-parse HEAD 2>/dev/null || echo unknown)" \
        -f "docker/$role.Dockerfile" -t "$image" . >/dev/null
}

need_tools
build_base
same_python
build_wheelhouse
for role in aggregator coordinator client; do
    build_role "$role"
done
# What these builds left dangling: build stages and replaced role images (labelled built-by), and
# role images from before that label (known by their titles).
for label in org.tally.built-by=docker/build-images.sh org.opencontainers.image.title=tally-{aggregator,coordinator,client}; do
    "${PODMAN[@]}" image prune --force --filter "label=$label" >/dev/null
done
"${PODMAN[@]}" images --filter reference='localhost/tally-*' --format '{{.Repository}}:{{.Tag}} {{.Size}}'
if [ -n "${REGISTRY:-}" ]; then
    TAG=$TAG bash docker/push-images.sh
fi
