#!/usr/bin/env bash
# `make images REGISTRY=host[:port]/prefix`: push the three role images `make images` built to a
# registry and pin them by digest in one place, the images component: each entry becomes
#   - name: tally-ROLE
#     newName: REGISTRY/tally-ROLE
#     digest: sha256:...
# as `kustomize edit set image tally-ROLE=REGISTRY/tally-ROLE@sha256:...` writes it, so every overlay
# renders the exact bytes pushed (a tag can be moved; a digest cannot).
# Environment: REGISTRY (required), TLS_VERIFY (false for a plain-HTTP registry such as one on
# 127.0.0.1; default true), IMAGES_COMPONENT (default k8s/components/images), TAG (the local
# images' tag and the pushed one; default: the version).
set -euo pipefail
cd "$(dirname "$0")/.."

: "${REGISTRY:?REGISTRY=host[:port]/prefix names the registry to push to}"
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
TLS_VERIFY=${TLS_VERIFY:-true}
COMPONENT=${IMAGES_COMPONENT:-k8s/components/images}/kustomization.yaml
PODMAN=(podman --cgroup-manager=cgroupfs)
REGISTRY=${REGISTRY%/}
TAG=${TAG:-$VERSION}

entries=""
for role in aggregator coordinator client; do
    digest_file=$(mktemp)
    printf '[images] push %s/tally-%s:%s\n' "$REGISTRY" "$role" "$TAG" >&2
    "${PODMAN[@]}" push --quiet --tls-verify="$TLS_VERIFY" --digestfile "$digest_file" \
        "localhost/tally-$role:$TAG" "docker://$REGISTRY/tally-$role:$TAG"
    digest=$(cat "$digest_file")
    rm -f "$digest_file"
    [[ $digest == sha256:* ]] || { printf '[images] no digest for tally-%s\n' "$role" >&2; exit 1; }
    entries+="  - name: tally-$role"$'\n'"    newName: $REGISTRY/tally-$role"$'\n'"    digest: $digest"$'\n'
done
# The component's comments stay; its images: list is replaced.
header=$(sed '/^images:/,$d' "$COMPONENT")
printf '%s\nimages:\n%s' "$header" "$entries" > "$COMPONENT"
printf '[images] pinned by digest in %s\n' "$COMPONENT" >&2
