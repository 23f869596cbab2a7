#!/usr/bin/env bash
# `make publish REGISTRY=host[:port]/path`: pushes the OCI image layout `make image` wrote
# (target/oci) to REGISTRY with skopeo, every tag it holds (the crate version and latest), and
# checks that the registry holds the very manifest digest that was built (the `sha256` the
# manifests in deploy/ pin).
#
# Credentials: skopeo's own auth file (`skopeo login HOST` writes it, or set REGISTRY_AUTH_FILE).
# Nothing here takes a password on the command line, where every process could read it.
# PUBLISH_TLS_VERIFY=false allows a plain-HTTP or self-signed registry (a local one for tests).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "${REPO_ROOT}"

layout="${OCI_LAYOUT:-target/oci}"
registry="${1:-${REGISTRY:-}}"
tls_verify="${PUBLISH_TLS_VERIFY:-true}"

[[ -n "${registry}" ]] || die "REGISTRY is not set: make publish REGISTRY=registry.example.com/team/llm-governor"
case "${registry}" in
  *://*) die "REGISTRY=${registry}: give host[:port]/path without a scheme (skopeo's docker:// is added here)" ;;
esac
# host[:port]/repository, the repository in the distribution spec's grammar, no tag or digest.
repo_re='^[A-Za-z0-9.-]+(:[0-9]+)?(/[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*)+$'
if ! [[ "${registry}" =~ ${repo_re} ]]; then
  die "REGISTRY=${registry}: expected host[:port]/path (lower-case path, no :tag or @digest), e.g. ghcr.io/acme/llm-governor"
fi
case "${tls_verify}" in
  true|false) ;;
  *) die "PUBLISH_TLS_VERIFY=${tls_verify}: true or false" ;;
esac
[[ -f "${layout}/index.json" ]] || die "${layout}/index.json missing: run make image first"

skopeo="$(scripts/ensure-deploy-tools.sh skopeo)"

# The tags and the one manifest digest in the layout's index.
mapfile -t refs < <(python3 - "${layout}/index.json" <<'PY'
import json, sys
index = json.load(open(sys.argv[1]))
for m in index.get("manifests", []):
    tag = m.get("annotations", {}).get("org.opencontainers.image.ref.name")
    if tag:
        print(tag, m["digest"])
PY
)
[[ ${#refs[@]} -gt 0 ]] || die "${layout}/index.json names no tag: run make image again"

digestfile="$(mktemp)"
trap 'rm -f "${digestfile}"' EXIT
for ref in "${refs[@]}"; do
  tag="${ref%% *}"
  built="${ref#* }"
  say "pushing ${layout}:${tag} to docker://${registry}:${tag}"
  # --preserve-digests: refuse rather than rewrite the manifest (a new digest would break the pin).
  "${skopeo}" copy --quiet --preserve-digests --dest-tls-verify="${tls_verify}" \
    --digestfile "${digestfile}" "oci:${layout}:${tag}" "docker://${registry}:${tag}" >&2
  pushed="$(cat "${digestfile}")"
  [[ "${pushed}" == "${built}" ]] || die "the registry stored ${registry}:${tag} as ${pushed}, but make image built ${built}"
  printf '%s:%s@%s\n' "${registry}" "${tag}" "${pushed}"
done
