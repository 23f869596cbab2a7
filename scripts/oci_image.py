#!/usr/bin/env python3
"""The module as an OCI image layout, with no container engine: `make image`.

    scripts/oci_image.py build [--module M] [--out target/oci] [--tag T ...] [--rewrite-manifests]
    scripts/oci_image.py digest [--module M]

The image is the "compat" variant of the Wasm image spec that Istio's and Envoy Gateway's
fetchers read: one OCI image manifest (never an index), config
`application/vnd.oci.image.config.v1+json`, one `application/vnd.oci.image.layer.v1.tar+gzip`
layer whose tar holds `plugin.wasm`. The manifest digest is what `sha256` means in a WasmPlugin
and in an EnvoyExtensionPolicy.

Reproducible on any machine: the digest is a function of the module's bytes alone.
- The tar has one entry, `plugin.wasm`, ustar, mode 0644, uid/gid 0, no user or group names,
  mtime 0, whatever the file on disk says.
- The gzip stream is written here, not by zlib's compressor: a gzip header with mtime 0, no
  name and OS 255, then deflate *stored* blocks (RFC 1951 §3.2.4), then CRC-32 and length.
  zlib's compressed output differs between zlib builds (zlib-ng, which some distributions ship
  as their zlib, and the SIMD forks), so a compressed layer would get another digest on another
  machine; stored blocks are the same bytes everywhere and every gzip reader takes them. The
  cost is size: the layer is the module plus ~2 KiB.
- JSON is written with sorted keys and no whitespace; no timestamp or build host is recorded.
The module itself is reproducible for the same rustc and Cargo home (Cargo puts registry paths
into panic locations), which CI and this project's machines share.

Only the standard library is used, so `make image` needs nothing but python3.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import struct
import sys
import tarfile
import zlib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODULE = REPO_ROOT / "target" / "wasm32-wasip1" / "release" / "llm_governor.wasm"
DEFAULT_OUT = REPO_ROOT / "target" / "oci"
# The manifests whose image digest `build --rewrite-manifests` keeps in step with the module.
PINNED_MANIFESTS = (
    REPO_ROOT / "deploy" / "istio" / "wasmplugin.yaml",
    REPO_ROOT / "deploy" / "istio" / "envoyfilter-stop-iteration.yaml",
    REPO_ROOT / "deploy" / "envoy-gateway" / "envoyextensionpolicy.yaml",
)

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
PLUGIN_FILE = "plugin.wasm"
WASM_MAGIC = b"\0asm"
# A stored deflate block carries at most 65535 bytes.
STORED_BLOCK = 0xFFFF


class ImageError(Exception):
    pass


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def canonical_json(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def crate_version() -> str:
    text = (REPO_ROOT / "Cargo.toml").read_text()
    match = re.search(r'^\[package\][^\[]*?^version\s*=\s*"([^"]+)"', text, re.S | re.M)
    if not match:
        raise ImageError("Cargo.toml: no [package] version")
    return match.group(1)


def plugin_tar(module: bytes, name: str = PLUGIN_FILE) -> bytes:
    """An uncompressed tar with the module as `name`, every field fixed."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.size = len(module)
        info.mode = 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        info.type = tarfile.REGTYPE
        tar.addfile(info, io.BytesIO(module))
    return buf.getvalue()


def stored_gzip(data: bytes) -> bytes:
    """RFC 1952 gzip of data in deflate stored blocks: the same bytes on every machine."""
    # ID1 ID2, CM=8 (deflate), FLG=0 (no name, comment or extra), MTIME=0, XFL=0, OS=255.
    out = bytearray(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff")
    chunks = [data[i:i + STORED_BLOCK] for i in range(0, len(data), STORED_BLOCK)] or [b""]
    for index, chunk in enumerate(chunks):
        final = 1 if index == len(chunks) - 1 else 0
        # BFINAL and BTYPE=00 in the first bits; stored blocks then start on a byte boundary.
        out.append(final)
        out += struct.pack("<HH", len(chunk), len(chunk) ^ 0xFFFF)
        out += chunk
    out += struct.pack("<II", zlib.crc32(data) & 0xFFFFFFFF, len(data) & 0xFFFFFFFF)
    return bytes(out)


def image_blobs(module: bytes) -> tuple:
    """(manifest bytes, {digest: blob}) of the compat image of module."""
    if module[:4] != WASM_MAGIC or len(module) < 8:
        raise ImageError("not a wasm module (no \\0asm header): build it with `make build`")
    tar = plugin_tar(module)
    layer = stored_gzip(tar)
    config = canonical_json({
        # GOARCH/GOOS spelling of the module's target (wasm32-wasip1): the image runs nowhere
        # but inside a wasm VM. The fetchers read a single manifest without looking at it.
        "architecture": "wasm",
        "os": "wasip1",
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": [sha256(tar)]},
    })
    manifest = canonical_json({
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "digest": sha256(config), "size": len(config)},
        "layers": [{
            "mediaType": LAYER_TYPE,
            "digest": sha256(layer),
            "size": len(layer),
            "annotations": {"org.opencontainers.image.title": PLUGIN_FILE},
        }],
        "annotations": {
            "module.wasm.image/variant": "compat",
            "org.opencontainers.image.title": "llm-governor",
        },
    })
    blobs = {sha256(config): config, sha256(layer): layer, sha256(manifest): manifest}
    return manifest, blobs


def manifest_digest(module: bytes) -> str:
    manifest, _ = image_blobs(module)
    return sha256(manifest)


def write_layout(module: bytes, out: Path, tags: list) -> str:
    """Writes an OCI image layout at out (replacing what was there); returns the digest."""
    manifest, blobs = image_blobs(module)
    digest = sha256(manifest)
    blob_dir = out / "blobs" / "sha256"
    if out.exists():
        for old in sorted(out.rglob("*"), reverse=True):
            old.unlink() if old.is_file() or old.is_symlink() else old.rmdir()
    blob_dir.mkdir(parents=True, exist_ok=True)
    for blob_digest, blob in sorted(blobs.items()):
        (blob_dir / blob_digest.split(":", 1)[1]).write_bytes(blob)
    (out / "oci-layout").write_bytes(canonical_json({"imageLayoutVersion": "1.0.0"}))
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": MANIFEST_TYPE,
                "digest": digest,
                "size": len(manifest),
                "annotations": {"org.opencontainers.image.ref.name": tag},
            }
            for tag in tags
        ],
    }
    (out / "index.json").write_bytes(canonical_json(index))
    return digest


# The pinned digest in a manifest: `sha256: <64 hex>` (WasmPlugin, EnvoyExtensionPolicy) and
# `sha256: "<64 hex>"` inside an EnvoyFilter's remote code.
PIN = re.compile(r'^(\s*sha256:\s*"?)([0-9a-f]{64})("?\s*(?:#.*)?)$', re.M)


def pinned_digests(path: Path) -> list:
    return [m[1] for m in PIN.findall(path.read_text())]


def rewrite_manifests(digest: str, paths=PINNED_MANIFESTS) -> list:
    """Sets every pinned image digest in paths to digest; returns the files it changed."""
    hex_digest = digest.split(":", 1)[1]
    changed = []
    for path in paths:
        if not path.exists():
            continue
        text = path.read_text()
        if not PIN.search(text):
            raise ImageError(f"{path.relative_to(REPO_ROOT)}: no `sha256: <digest>` line to pin")
        new = PIN.sub(lambda m: m.group(1) + hex_digest + m.group(3), text)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


def read_module(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ImageError(f"{path} missing: run make build") from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="write the OCI image layout and print its digest")
    build.add_argument("--module", type=Path, default=DEFAULT_MODULE)
    build.add_argument("--out", type=Path, default=DEFAULT_OUT)
    build.add_argument("--tag", action="append", help="tags (default: the crate version and latest)")
    build.add_argument("--rewrite-manifests", action="store_true",
                       help="pin deploy/'s manifests to the digest built")
    digest = sub.add_parser("digest", help="print the manifest digest the module's image has")
    digest.add_argument("--module", type=Path, default=DEFAULT_MODULE)
    args = parser.parse_args(argv)
    try:
        module = read_module(args.module)
        if args.command == "digest":
            print(manifest_digest(module))
            return 0
        tags = args.tag or [crate_version(), "latest"]
        for tag in tags:
            # The OCI distribution spec's tag grammar.
            if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}", tag):
                raise ImageError(f"invalid tag {tag!r}: letters, digits, '_', '.', '-', at most 128")
        image_digest = write_layout(module, args.out, tags)
        shown = os.path.relpath(args.out, Path.cwd())
        print(f"image: {shown} (oci layout, tags {', '.join(tags)}) — {len(module)} byte module",
              file=sys.stderr)
        if args.rewrite_manifests:
            for path in rewrite_manifests(image_digest):
                print(f"pinned {path.relative_to(REPO_ROOT)} to {image_digest}", file=sys.stderr)
        print(image_digest)
        return 0
    except ImageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
