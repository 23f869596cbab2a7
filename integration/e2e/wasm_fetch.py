"""The Wasm image fetch of Istio's agent and Envoy Gateway's controller, rewritten in Python for
the tests: a registry client (distribution API v2 over plain HTTP on loopback) and the rules by
which both fetchers turn an image reference and an expected `sha256` into module bytes, or
refuse.

The rules, as read in istio/istio `pkg/wasm/imagefetcher.go` and `cache.go`, and in
envoyproxy/gateway `internal/wasm/imagefetcher.go` (EG's is Istio's, plus a 256 MiB limit);
both pull with go-containerregistry:
1. The reference resolves to a manifest. An image index (or Docker manifest list) is resolved by
   platform, linux/amd64 by default: a child whose descriptor names that platform, else
   "no child with platform linux/amd64 in index" (go-containerregistry `childByPlatform`).
2. The expected `sha256` is compared with the digest of the image manifest before anything is
   extracted: "module downloaded from ... has checksum X, which does not match: Y".
3. A Docker v2 manifest: its last layer must be `application/vnd.docker.image.rootfs.diff.tar.gzip`.
   Otherwise the compat variant: the last layer must be
   `application/vnd.oci.image.layer.v1.tar+gzip`; it is gunzipped and walked as a tar, and the
   first entry whose base name is `plugin.wasm` is the module. Failing that, the two-layer oci
   variant (`application/vnd.module.wasm.content.layer.v1+wasm`). Failing both: an error naming
   both reasons.
4. Layers are read through their digest (go-containerregistry verifies each blob it reads).
5. The result must start with the wasm magic `\\0asm` and be at least 8 bytes (`isValidWasmBinary`).

No upstream code is copied: this is the behaviour, written for these tests.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import posixpath
import tarfile
import zlib
from typing import Callable, Optional

import requests

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar.gzip"
WASM_CONTENT_LAYER = "application/vnd.module.wasm.content.layer.v1+wasm"
PLUGIN_FILE = "plugin.wasm"
DEFAULT_PLATFORM = ("linux", "amd64")
MAX_WASM_SIZE = 256 * 1024 * 1024  # Envoy Gateway's limit on the uncompressed layer read


class FetchError(Exception):
    """The image was refused, for the reason a fetcher would give."""


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Registry:
    """A distribution (API v2) registry over plain HTTP, e.g. Debian's docker-registry on loopback."""

    def __init__(self, address: str):
        self.base = f"http://{address}"
        self.session = requests.Session()

    def get_manifest(self, repo: str, reference: str) -> tuple:
        """(bytes, media type) of a manifest or index by tag or digest."""
        r = self.session.get(
            f"{self.base}/v2/{repo}/manifests/{reference}",
            headers={"Accept": ", ".join([OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST])},
            timeout=10,
        )
        if r.status_code != 200:
            raise FetchError(f"could not fetch manifest: {repo}:{reference}: HTTP {r.status_code} {r.text[:200]}")
        media_type = r.headers.get("Content-Type", "").split(";")[0].strip()
        try:
            media_type = json.loads(r.content).get("mediaType") or media_type
        except ValueError:
            raise FetchError(f"could not fetch manifest: {repo}:{reference}: not JSON") from None
        return r.content, media_type

    def get_blob(self, repo: str, digest: str) -> bytes:
        r = self.session.get(f"{self.base}/v2/{repo}/blobs/{digest}", timeout=30)
        if r.status_code != 200:
            raise FetchError(f"could not get layer content: {digest}: HTTP {r.status_code}")
        return r.content

    def put_blob(self, repo: str, data: bytes) -> str:
        digest = sha256_digest(data)
        start = self.session.post(f"{self.base}/v2/{repo}/blobs/uploads/", timeout=10)
        start.raise_for_status()
        location = start.headers["Location"]
        if location.startswith("/"):
            location = self.base + location
        sep = "&" if "?" in location else "?"
        done = self.session.put(
            f"{location}{sep}digest={digest}", data=data,
            headers={"Content-Type": "application/octet-stream"}, timeout=30,
        )
        done.raise_for_status()
        return digest

    def put_manifest(self, repo: str, reference: str, data: bytes, media_type: str) -> str:
        r = self.session.put(
            f"{self.base}/v2/{repo}/manifests/{reference}", data=data,
            headers={"Content-Type": media_type}, timeout=10,
        )
        if r.status_code >= 300:
            raise RuntimeError(f"registry refused manifest {repo}:{reference}: {r.status_code} {r.text[:300]}")
        return r.headers.get("Docker-Content-Digest", sha256_digest(data))


def _child_by_platform(index: dict, platform: tuple) -> dict:
    os_name, arch = platform
    for child in index.get("manifests", []):
        p = child.get("platform")
        if p and p.get("os") == os_name and p.get("architecture") == arch:
            return child
    raise FetchError(f"could not fetch image: no child with platform {os_name}/{arch} in index")


def _verified(blob: bytes, digest: str) -> bytes:
    if sha256_digest(blob) != digest:
        raise FetchError(f"could not get layer content: error verifying sha256 checksum; got {sha256_digest(blob)}, want {digest}")
    return blob


def _plugin_from_tar_gzip(layer: bytes) -> bytes:
    try:
        raw = gzip.GzipFile(fileobj=io.BytesIO(layer)).read(MAX_WASM_SIZE)
    except (OSError, EOFError, zlib.error) as err:
        raise FetchError(f"failed to parse layer as tar.gz: {err}") from None
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
            for member in tar:
                if posixpath.basename(member.name) == PLUGIN_FILE:
                    f = tar.extractfile(member)
                    if f is None:
                        raise FetchError(f"failed to read {PLUGIN_FILE}: not a regular file")
                    return f.read()
    except tarfile.TarError as err:
        raise FetchError(f"could not extract wasm binary: {err}") from None
    raise FetchError(f"{PLUGIN_FILE} not found in the archive")


def _last_layer(manifest: dict, want: str) -> dict:
    layers = manifest.get("layers") or []
    if not layers:
        raise FetchError("number of layers must be greater than zero")
    layer = layers[-1]
    if layer.get("mediaType") != want:
        raise FetchError(f"invalid media type {layer.get('mediaType')} (expect {want})")
    return layer


def extract_module(manifest: dict, get_blob: Callable[[str], bytes]) -> bytes:
    """The module inside an image manifest, by the fetchers' variant rules (step 3 and 4)."""
    if manifest.get("mediaType") == DOCKER_MANIFEST:
        layer = _last_layer(manifest, DOCKER_LAYER)
        return _plugin_from_tar_gzip(_verified(get_blob(layer["digest"]), layer["digest"]))
    try:
        layer = _last_layer(manifest, OCI_LAYER_GZIP)
        return _plugin_from_tar_gzip(_verified(get_blob(layer["digest"]), layer["digest"]))
    except FetchError as compat_error:
        errors = [f"could not parse as compat variant: {compat_error}"]
    layers = manifest.get("layers") or []
    if len(layers) != 2:
        errors.append(f"could not parse as oci variant: number of layers must be 2 but got {len(layers)}")
    else:
        wasm_layers = [l for l in layers if l.get("mediaType") == WASM_CONTENT_LAYER]
        if wasm_layers:
            return _verified(get_blob(wasm_layers[0]["digest"]), wasm_layers[0]["digest"])
        errors.append(f"could not parse as oci variant: could not find the layer of type {WASM_CONTENT_LAYER}")
    raise FetchError("the given image is in invalid format as an OCI image: " + "; ".join(errors))


def fetch_module(
    registry: Registry, repo: str, reference: str, sha256: Optional[str] = None,
    platform: tuple = DEFAULT_PLATFORM,
) -> tuple:
    """(module bytes, manifest digest) of repo:reference, as Istio's agent and EG fetch it.

    sha256: the hex digest a WasmPlugin or EnvoyExtensionPolicy pins (empty/None: no check).
    """
    data, media_type = registry.get_manifest(repo, reference)
    if media_type in (OCI_INDEX, DOCKER_LIST):
        child = _child_by_platform(json.loads(data), platform)
        data, media_type = registry.get_manifest(repo, child["digest"])
    digest = sha256_digest(data)
    if sha256 and digest.split(":", 1)[1] != sha256:
        raise FetchError(
            f"module downloaded from {registry.base}/{repo}:{reference} has checksum "
            f"{digest.split(':', 1)[1]}, which does not match: {sha256}"
        )
    module = extract_module(json.loads(data), lambda d: registry.get_blob(repo, d))
    if len(module) < 8 or module[:4] != b"\0asm":
        raise FetchError(f"fetched Wasm binary from {repo}:{reference} is invalid")
    return module, digest
