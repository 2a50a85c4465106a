"""Model stores laid out on disk as Ollama, LM Studio and huggingface_hub lay them out.

    ollama_store(root, {"qwen2.5-coder:1.5b": path})      # manifests/ + blobs/sha256-<hex>
    lmstudio_store(root, {"pub/repo/file.gguf": path})    # <publisher>/<repo>/<file>
    hf_cache(root, {"org/repo": {"file.gguf": path}})     # models--org--repo/{refs,snapshots,blobs}

Files are hard-linked when they can be (as cheap as a symlink, and a real file like Ollama's
blobs), else copied. Used by tests/test_stores.py and for checking the README by hand.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

OLLAMA_HOST = "registry.ollama.ai"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def place(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _blob(blobs: Path, data: bytes | None = None, src: Path | None = None) -> dict:
    if src is not None:
        digest, size = sha256_of(src), src.stat().st_size
        place(src, blobs / f"sha256-{digest}")
    else:
        assert data is not None
        digest, size = hashlib.sha256(data).hexdigest(), len(data)
        (blobs / f"sha256-{digest}").write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": size}


def ollama_manifest_path(root: Path, name: str) -> Path:
    model, _, tag = name.partition(":")
    parts = model.split("/")
    host, ns = OLLAMA_HOST, "library"
    if len(parts) == 2:
        ns = parts[0]
    elif len(parts) == 3:
        host, ns = parts[0], parts[1]
    return root / "manifests" / host / ns / parts[-1] / (tag or "latest")


def ollama_store(root: Path, models: dict[str, Path], projector: Path | None = None) -> Path:
    """Schema-2 manifests: a config, the GGUF model layer, a template and a params layer, and
    (for every model, when given) a projector layer."""
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    for name, src in models.items():
        config = _blob(blobs, json.dumps({"model_format": "gguf", "model_family": "llama"}).encode())
        layers = [
            {"mediaType": "application/vnd.ollama.image.model", **_blob(blobs, src=src)},
            {"mediaType": "application/vnd.ollama.image.template", **_blob(blobs, b"{{ .Prompt }}")},
            {"mediaType": "application/vnd.ollama.image.params", **_blob(blobs, b'{"stop": ["<|im_end|>"]}')},
        ]
        if projector is not None:
            layers.append({"mediaType": "application/vnd.ollama.image.projector", **_blob(blobs, src=projector)})
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json", **config},
            "layers": layers,
        }
        path = ollama_manifest_path(root, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(manifest), encoding="utf-8")
    return root


def lmstudio_store(root: Path, files: dict[str, Path]) -> Path:
    for rel, src in files.items():
        place(src, root / rel)
    return root


def hf_cache(root: Path, repos: dict[str, dict[str, Path]], commit: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """huggingface_hub's cache: blobs named by sha256, snapshot files as relative symlinks."""
    for repo, files in repos.items():
        org, name = repo.split("/")
        d = root / f"models--{org}--{name}"
        (d / "refs").mkdir(parents=True, exist_ok=True)
        (d / "refs" / "main").write_text(commit)
        for rel, src in files.items():
            digest = sha256_of(src)
            place(src, d / "blobs" / digest)
            link = d / "snapshots" / commit / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(os.path.relpath(d / "blobs" / digest, link.parent))
    return root
