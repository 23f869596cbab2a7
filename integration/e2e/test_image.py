"""`make image` and `make publish`: the OCI image Istio and Envoy Gateway pull.

- The layout `make image` writes is the compat variant (one manifest, one tar+gzip layer holding
  plugin.wasm), every byte fixed: a second build, from a copy of the module with another mtime
  and mode, gives the same digest.
- `make publish` pushes it with skopeo to Debian's docker-registry on loopback; pulled back by
  the fetchers' rules (integration/e2e/wasm_fetch.py) the module is byte for byte the one built,
  and skopeo reads back the same digest.
- What the fetchers refuse, our fetch refuses too, one test each: a digest that is not the
  pinned one, an image without plugin.wasm, an index without a linux/amd64 child, an
  uncompressed layer.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from harness import REPO_ROOT, WASM_MODULE, wasm_only
from servers import LocalRegistry, require
from wasm_fetch import (
    OCI_INDEX, OCI_LAYER_TAR, OCI_MANIFEST, FetchError, Registry, fetch_module, sha256_digest,
)

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import oci_image  # noqa: E402

# The image and the manifests carry the wasm module: checked once, in the wasm pass.
pytestmark = wasm_only("the image and the manifests carry the wasm module")

IMAGE_SCRIPT = REPO_ROOT / "scripts" / "oci_image.py"
PUBLISH_SCRIPT = REPO_ROOT / "scripts" / "publish.sh"


def build(out: Path, module: Path = WASM_MODULE, *extra: str) -> subprocess.CompletedProcess:
    # The system python3, as `make image` runs it: the script needs the standard library only.
    return subprocess.run(
        ["python3", str(IMAGE_SCRIPT), "build", "--module", str(module), "--out", str(out), *extra],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
    )


def blob(layout: Path, digest: str) -> bytes:
    return (layout / "blobs" / "sha256" / digest.split(":", 1)[1]).read_bytes()


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> tuple:
    out = tmp_path_factory.mktemp("oci") / "oci"
    result = build(out)
    assert result.returncode == 0, result.stderr
    digest = result.stdout.strip()
    assert digest.startswith("sha256:") and len(digest) == 71, result.stdout
    return out, digest


@pytest.fixture(scope="module")
def registry():
    with LocalRegistry(require("docker-registry")) as reg:
        yield reg


def test_the_layout_is_the_compat_variant_with_plugin_wasm(layout):
    out, digest = layout
    assert json.loads((out / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((out / "index.json").read_text())
    tags = {m["annotations"]["org.opencontainers.image.ref.name"]: m for m in index["manifests"]}
    assert set(tags) == {oci_image.crate_version(), "latest"}, tags
    assert {m["digest"] for m in tags.values()} == {digest}
    assert {m["mediaType"] for m in tags.values()} == {OCI_MANIFEST}

    manifest_bytes = blob(out, digest)
    assert sha256_digest(manifest_bytes) == digest
    manifest = json.loads(manifest_bytes)
    assert manifest["mediaType"] == OCI_MANIFEST and manifest["schemaVersion"] == 2
    assert manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    assert [l["mediaType"] for l in manifest["layers"]] == ["application/vnd.oci.image.layer.v1.tar+gzip"]
    layer_desc = manifest["layers"][0]
    layer = blob(out, layer_desc["digest"])
    assert len(layer) == layer_desc["size"] and sha256_digest(layer) == layer_desc["digest"]

    # gzip header: no mtime, no file name (FLG 0), so no build time or path is recorded.
    assert layer[:4] == b"\x1f\x8b\x08\x00" and layer[4:8] == b"\0\0\0\0"
    raw = gzip.decompress(layer)
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        members = tar.getmembers()
        assert [(m.name, m.mode, m.uid, m.gid, m.uname, m.gname, m.mtime, m.isreg()) for m in members] == [
            ("plugin.wasm", 0o644, 0, 0, "", "", 0, True)
        ]
        assert tar.extractfile(members[0]).read() == WASM_MODULE.read_bytes()
    config = json.loads(blob(out, manifest["config"]["digest"]))
    assert config["rootfs"] == {"type": "layers", "diff_ids": [sha256_digest(raw)]}


def test_a_second_build_of_the_same_module_gives_the_same_digest(layout, tmp_path):
    out, digest = layout
    # Another path, another mtime and mode, another umask, another working directory: none of
    # it may reach the image.
    copy = tmp_path / "elsewhere" / "module.wasm"
    copy.parent.mkdir()
    copy.write_bytes(WASM_MODULE.read_bytes())
    os.chmod(copy, 0o600)
    os.utime(copy, (1_700_000_000, 1_700_000_000))
    old_umask = os.umask(0o077)
    try:
        second = build(tmp_path / "second", copy)
    finally:
        os.umask(old_umask)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == digest
    first_files = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    second_files = {p.relative_to(tmp_path / "second"): p.read_bytes() for p in (tmp_path / "second").rglob("*") if p.is_file()}
    assert first_files == second_files
    # `digest` (what the deploy tests compare the manifests with) agrees with `build`.
    again = subprocess.run(["python3", str(IMAGE_SCRIPT), "digest", "--module", str(copy)],
                           capture_output=True, text=True, timeout=60)
    assert again.stdout.strip() == digest, again.stderr


def test_another_module_gives_another_digest(layout, tmp_path):
    _, digest = layout
    other = tmp_path / "other.wasm"
    other.write_bytes(WASM_MODULE.read_bytes() + b"\0")  # a trailing byte: still starts \0asm
    assert oci_image.manifest_digest(other.read_bytes()) != digest


def test_build_refuses_a_file_that_is_not_a_wasm_module(tmp_path):
    bogus = tmp_path / "notwasm.wasm"
    bogus.write_bytes(b"#!/bin/sh\necho hi\n")
    result = build(tmp_path / "out", bogus)
    assert result.returncode == 1
    assert "not a wasm module" in result.stderr, result.stderr
    missing = build(tmp_path / "out", tmp_path / "absent.wasm")
    assert missing.returncode == 1 and "run make build" in missing.stderr, missing.stderr


def test_skopeo_reads_the_layout(layout):
    out, digest = layout
    skopeo = require("skopeo")
    raw = subprocess.run([skopeo, "inspect", "--raw", f"oci:{out}:latest"], capture_output=True, timeout=60)
    assert raw.returncode == 0, raw.stderr
    assert sha256_digest(raw.stdout) == digest
    info = subprocess.run([skopeo, "inspect", f"oci:{out}:{oci_image.crate_version()}"],
                          capture_output=True, text=True, timeout=60)
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["Digest"] == digest


def publish(layout_dir: Path, registry_ref: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(PUBLISH_SCRIPT), registry_ref], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
        env={**os.environ, "OCI_LAYOUT": str(layout_dir), **env},
    )


def test_publish_pushes_and_the_fetchers_pull_back_the_same_module(layout, registry, tmp_path):
    out, digest = layout
    repo = "team/llm-governor"
    result = publish(out, f"{registry.address}/{repo}", PUBLISH_TLS_VERIFY="false")
    assert result.returncode == 0, result.stderr
    pushed = set(result.stdout.split())
    assert pushed == {f"{registry.address}/{repo}:{tag}@{digest}" for tag in (oci_image.crate_version(), "latest")}

    client = Registry(registry.address)
    for tag in (oci_image.crate_version(), "latest"):
        module, got_digest = fetch_module(client, repo, tag, sha256=digest.split(":", 1)[1])
        assert got_digest == digest
        assert module == WASM_MODULE.read_bytes()
    # By digest, as `oci://host/repo@sha256:...` would fetch it.
    module, _ = fetch_module(client, repo, digest)
    assert module == WASM_MODULE.read_bytes()

    # And skopeo, another client, copies it back unchanged.
    skopeo = require("skopeo")
    pulled = tmp_path / "pulled"
    copy = subprocess.run(
        [skopeo, "copy", "--quiet", "--src-tls-verify=false", f"docker://{registry.address}/{repo}:latest",
         f"oci:{pulled}:latest"], capture_output=True, text=True, timeout=120,
    )
    assert copy.returncode == 0, copy.stderr
    index = json.loads((pulled / "index.json").read_text())
    assert [m["digest"] for m in index["manifests"]] == [digest]


def test_publish_refuses_a_bad_registry_reference(layout):
    out, _ = layout
    for ref, reason in [
        ("", "REGISTRY is not set"),
        ("https://ghcr.io/acme/llm-governor", "without a scheme"),
        ("ghcr.io/acme/llm-governor:0.1.0", "no :tag or @digest"),
        ("ghcr.io/Acme/llm-governor", "lower-case path"),
        ("ghcr.io", "expected host[:port]/path"),
    ]:
        result = publish(out, ref, REGISTRY="")
        assert result.returncode != 0, ref
        assert reason in result.stderr, (ref, result.stderr)
    missing = publish(out.parent / "absent", "127.0.0.1:1/x")
    assert missing.returncode != 0 and "run make image first" in missing.stderr, missing.stderr


# --- what the fetchers refuse ----------------------------------------------------------------


def push_image(client: Registry, repo: str, tag: str, layer: bytes, layer_type: str) -> tuple:
    """Pushes a one-layer image (config + layer + manifest); returns (manifest bytes, digest)."""
    config = oci_image.canonical_json({"architecture": "wasm", "os": "wasip1", "config": {},
                                       "rootfs": {"type": "layers", "diff_ids": []}})
    client.put_blob(repo, config)
    client.put_blob(repo, layer)
    manifest = oci_image.canonical_json({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": sha256_digest(config), "size": len(config)},
        "layers": [{"mediaType": layer_type, "digest": sha256_digest(layer), "size": len(layer)}],
    })
    return manifest, client.put_manifest(repo, tag, manifest, OCI_MANIFEST)


def test_a_digest_that_is_not_the_pinned_one_is_refused(layout, registry):
    out, digest = layout
    client = Registry(registry.address)
    manifest, blobs = oci_image.image_blobs(WASM_MODULE.read_bytes())
    for d, data in blobs.items():
        if d != digest:
            client.put_blob("pin/llm-governor", data)
    client.put_manifest("pin/llm-governor", "latest", manifest, OCI_MANIFEST)
    assert fetch_module(client, "pin/llm-governor", "latest", sha256=digest.split(":", 1)[1])[1] == digest

    wrong = "0" * 64
    with pytest.raises(FetchError, match=f"checksum {digest.split(':', 1)[1]}, which does not match: {wrong}"):
        fetch_module(client, "pin/llm-governor", "latest", sha256=wrong)


def test_an_image_without_plugin_wasm_is_refused(registry):
    client = Registry(registry.address)
    # The module under its build name, as `COPY llm_governor.wasm /` would put it.
    layer = oci_image.stored_gzip(oci_image.plugin_tar(WASM_MODULE.read_bytes(), name="llm_governor.wasm"))
    push_image(client, "noplugin/llm-governor", "latest", layer, "application/vnd.oci.image.layer.v1.tar+gzip")
    with pytest.raises(FetchError, match="plugin.wasm not found in the archive"):
        fetch_module(client, "noplugin/llm-governor", "latest")


def test_an_image_index_without_a_linux_amd64_child_is_refused(layout, registry):
    out, digest = layout
    client = Registry(registry.address)
    manifest, blobs = oci_image.image_blobs(WASM_MODULE.read_bytes())
    for d, data in blobs.items():
        if d != digest:
            client.put_blob("index/llm-governor", data)
    client.put_manifest("index/llm-governor", digest, manifest, OCI_MANIFEST)
    # An index over our manifest, its child described with the module's own platform: the
    # fetchers resolve an index by linux/amd64 and find nothing to pull. That is why
    # `make image` publishes a single manifest.
    index = oci_image.canonical_json({
        "schemaVersion": 2, "mediaType": OCI_INDEX,
        "manifests": [{"mediaType": OCI_MANIFEST, "digest": digest, "size": len(manifest),
                       "platform": {"architecture": "wasm", "os": "wasip1"}}],
    })
    client.put_manifest("index/llm-governor", "latest", index, OCI_INDEX)
    with pytest.raises(FetchError, match="no child with platform linux/amd64 in index"):
        fetch_module(client, "index/llm-governor", "latest")
    # The control: the same index with the platform asked for resolves to our manifest, so
    # the refusal above is the platform rule, not a broken index.
    module, got = fetch_module(client, "index/llm-governor", "latest", platform=("wasip1", "wasm"))
    assert got == digest and module == WASM_MODULE.read_bytes()


def test_an_uncompressed_layer_is_refused(registry):
    client = Registry(registry.address)
    layer = oci_image.plugin_tar(WASM_MODULE.read_bytes())
    push_image(client, "plain/llm-governor", "latest", layer, OCI_LAYER_TAR)
    with pytest.raises(FetchError) as refused:
        fetch_module(client, "plain/llm-governor", "latest")
    message = str(refused.value)
    assert f"invalid media type {OCI_LAYER_TAR} (expect application/vnd.oci.image.layer.v1.tar+gzip)" in message
    assert "number of layers must be 2 but got 1" in message
