"""`specrun pull`: registry entries and ``hf:`` references, downloaded through huggingface_hub.

huggingface_hub does the transfer (HF_TOKEN, HF_ENDPOINT, retries, resuming a dropped
connection with a Range request, its progress bar); specrun chooses the files and checks them:

1. list the repo (``/api/models/<repo>/tree/main``) and pick the model the reference names,
   with every part of a split GGUF (``-00001-of-0000N.gguf``), by the same rules as the cache;
2. download each part: a registry entry's into a staging folder beside its ``path``, an
   ``hf:`` reference's into the Hugging Face cache (where ``hf:`` references then resolve);
3. hash what arrived against the registry's ``sha256`` or the Hub's LFS sha256 (the git
   blob id for small non-LFS files). A mismatch deletes the file and raises DownloadError, so
   no file that looks complete is ever left unverified; a registry file is moved to its
   ``path`` only after its hash matched.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specrun.errors import DownloadError, UnknownModel, UsageError
from specrun.models.registry import Entry, Registry
from specrun.models.stores import Ref, StoreRoots, parse_ref, pick_model, split_info

STAGING = ".specrun-pull"
HASH_CHUNK = 1 << 22


@dataclass(frozen=True)
class RemoteFile:
    path: str  # inside the repo
    size: int
    sha256: str | None  # LFS files
    git_oid: str | None  # the git blob id, for non-LFS files


@dataclass
class Pulled:
    label: str
    repo: str
    files: list[Path] = field(default_factory=list)
    downloaded: int = 0  # bytes fetched this time
    present: bool = False  # everything was already there


def hf_ref_of(name: str, registry: Registry) -> tuple[Ref, Entry | None]:
    """What ``specrun pull NAME`` downloads: a registry entry's ``hf`` (or its ``hf:`` path), or an ``hf:`` reference."""
    entry = registry.get(name)
    if entry is not None:
        if entry.hf:
            return parse_ref(f"hf:{entry.hf}"), entry
        if entry.ref and entry.ref.startswith("hf:"):
            return parse_ref(entry.ref), None  # its path is the cache itself
        if entry.ref:
            raise UsageError(
                f"{entry.name} is {entry.ref}: specrun pulls only from Hugging Face", "use that store's own tool (e.g. `ollama pull`)"
            )
        raise UsageError(
            f"registry entry {entry.name!r} has no hf reference to download from",
            f'add hf = "org/repo/file.gguf" to [models.{entry.name}] in {entry.origin}, or get it with: {entry.source or "your own download"}',
        )
    if name.lower().startswith("hf:"):
        return parse_ref(name), None
    if name.lower().startswith(("ollama:", "lmstudio:")):
        raise UsageError(
            f"{name}: specrun pulls only registry entries and hf: references", "use that store's own tool (e.g. `ollama pull`)"
        )
    raise UnknownModel(
        f"unknown model {name!r}: not a registry name or alias, nor an hf:org/repo reference", "run `specrun models` to list names"
    )


def destinations(entry: Entry, parts: list[str]) -> list[Path]:
    """Where a registry entry's files go: ``path`` itself, or for a split model its parts
    beside it, named ``<stem>-0000i-of-0000N.gguf`` after ``path``."""
    if len(parts) == 1:
        return [entry.path]
    info = split_info(entry.path.name)
    prefix = info[0] if info else entry.path.stem
    n = len(parts)
    return [entry.path.with_name(f"{prefix}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def file_digest(path: Path, algo: str = "sha256", git_size: int | None = None) -> str:
    h = hashlib.new(algo)
    if git_size is not None:
        h.update(f"blob {git_size}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _verify(path: Path, remote: RemoteFile, want_sha256: str | None) -> None:
    """Raise DownloadError (after deleting ``path``) unless its content is what was promised."""
    want = want_sha256 or remote.sha256
    if want:
        got, what = file_digest(path), "sha256"
    elif remote.git_oid:
        want, got, what = remote.git_oid, file_digest(path, "sha1", remote.size), "git blob id"
    else:
        return
    if got.lower() != want.lower():
        path.unlink(missing_ok=True)
        raise DownloadError(
            f"{remote.path}: {what} mismatch (expected {want[:16]}..., got {got[:16]}...); the file was deleted", "run `specrun pull` again"
        )


def list_repo(repo: str, roots: StoreRoots) -> list[RemoteFile]:
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    out = []
    with _hub_errors(f"hf:{repo}"):
        for item in HfApi(endpoint=roots.hf_endpoint).list_repo_tree(repo, recursive=True):
            if isinstance(item, RepoFile) and item.path.lower().endswith(".gguf"):
                lfs = item.lfs
                out.append(RemoteFile(item.path, int(item.size), lfs.sha256 if lfs else None, None if lfs else item.blob_id))
    return out


def pull(name: str, registry: Registry, roots: StoreRoots, log: Callable[[str], None] = lambda s: None) -> Pulled:
    """Download what ``name`` names (see the module docstring). Raises DownloadError on a
    network failure or checksum mismatch, UnknownModel when the repo or file does not exist."""
    ref, entry = hf_ref_of(name, registry)
    remote = {f.path: f for f in list_repo(ref.repo, roots)}
    parts = pick_model(remote, ref, f"{ref.repo} on the Hub")
    files = [remote[p] for p in parts]
    want = entry.sha256 if entry is not None and len(files) == 1 else None
    if want and files[0].sha256 and want.lower() != files[0].sha256.lower():
        raise DownloadError(
            f"{entry.name if entry else name}: the registry's sha256 {want[:16]}... differs from the Hub's {files[0].sha256[:16]}... for {ref.repo}/{files[0].path}",
            "update sha256 (or hf) in the registry entry",
        )
    out = Pulled(entry.name if entry else str(ref), ref.repo)
    if entry is not None:
        _pull_to_paths(ref, entry, files, want, roots, out, log)
    else:
        _pull_to_cache(ref, files, roots, out, log)
    out.present = out.downloaded == 0
    return out


def _pull_to_paths(
    ref: Ref, entry: Entry, files: list[RemoteFile], want: str | None, roots: StoreRoots, out: Pulled, log: Callable[[str], None]
) -> None:
    dests = destinations(entry, [f.path for f in files])
    staging = dests[0].parent / STAGING
    try:
        for f, dest in zip(files, dests):
            if dest.is_file() and dest.stat().st_size == f.size:
                log(f"{dest} is already there")
                out.files.append(dest)
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            log(f"fetching {ref.repo}/{f.path} ({f.size} bytes) -> {dest}")
            staged = Path(_download(ref.repo, f.path, roots, local_dir=staging))
            _verify(staged, f, want)
            os.replace(staged, dest)
            out.files.append(dest)
            out.downloaded += f.size
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _pull_to_cache(ref: Ref, files: list[RemoteFile], roots: StoreRoots, out: Pulled, log: Callable[[str], None]) -> None:
    cache = roots.hf_hub[0] if roots.hf_hub else None
    org, name = ref.repo.split("/")
    for f in files:
        blob = cache / f"models--{org}--{name}" / "blobs" / f.sha256 if cache and f.sha256 else None
        had = blob is not None and blob.is_file() and blob.stat().st_size == f.size
        log(
            f"{ref.repo}/{f.path} is already in the Hugging Face cache"
            if had
            else f"fetching {ref.repo}/{f.path} ({f.size} bytes) into the Hugging Face cache"
        )
        pointer = Path(_download(ref.repo, f.path, roots, cache_dir=cache))
        out.files.append(pointer)
        if had:
            continue
        try:
            _verify(Path(os.path.realpath(pointer)), f, None)
        except DownloadError:
            pointer.unlink(missing_ok=True)  # the snapshot link, now dangling
            raise
        out.downloaded += f.size


def _download(repo: str, filename: str, roots: StoreRoots, **where: Any) -> str:
    from huggingface_hub import hf_hub_download

    with _hub_errors(f"hf:{repo}/{filename}"):
        return str(hf_hub_download(repo, filename, endpoint=roots.hf_endpoint, **where))


@contextmanager
def _hub_errors(label: str) -> Iterator[None]:
    """huggingface_hub's and the network's exceptions as specrun's, with the fix to try."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RemoteEntryNotFoundError, RepositoryNotFoundError

    def first_line(e: BaseException) -> str:
        text = str(e).strip()
        return text.splitlines()[0] if text else type(e).__name__

    retry = "check the network (or HF_ENDPOINT) and run `specrun pull` again"
    try:
        yield
    except GatedRepoError as e:
        raise DownloadError(f"{label} is gated: {first_line(e)}", "accept its terms on the Hub and set HF_TOKEN") from None
    except (RepositoryNotFoundError, RemoteEntryNotFoundError):
        raise UnknownModel(f"{label} was not found on the Hub", "check the name (a private repo needs HF_TOKEN)") from None
    except (HfHubHTTPError, OSError) as e:
        raise DownloadError(f"downloading {label} failed: {first_line(e)}", retry) from None
    except Exception as e:
        if type(e).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore"):  # the transport's own errors
            raise DownloadError(f"downloading {label} failed: {first_line(e)}", retry) from None
        raise
