"""The model stores people already have: Ollama, LM Studio, the Hugging Face cache, llama.cpp's.

References name a model inside a store, wherever a model is named:

* ``ollama:NAME[:TAG]``: a manifest under ``<root>/manifests/<host>/<namespace>/<name>/<tag>``
  (host ``registry.ollama.ai`` and namespace ``library`` unless given, tag ``latest``); the
  GGUF is the blob of its ``application/vnd.ollama.image.model`` layer, ``<root>/blobs/sha256-<hex>``;
* ``lmstudio:PUBLISHER/REPO[/FILE.gguf or :QUANT]``: ``<root>/<publisher>/<repo>/<file>``;
* ``hf:ORG/REPO[/FILE.gguf or :QUANT]``: the Hugging Face cache, ``<root>/models--org--repo/``
  ``refs/main`` -> ``snapshots/<commit>/<file>`` -> ``blobs/<hash>``; llama.cpp's ``-hf`` cache
  is searched too.

These are files from elsewhere, so they are read like the GGUF header is: manifests are
size-bounded and checked field by field, directory walks are bounded and never follow
directory links, and every failure is one :class:`~specrun.errors.InputError` line (exit 3)
that names the file, never a traceback.

:func:`roots_from_env` is the one function that reads the environment; everything else takes
a :class:`StoreRoots`.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from specrun.errors import InputError, UnknownModel

PREFIXES = ("ollama", "lmstudio", "hf")
OLLAMA_HOST = "registry.ollama.ai"
OLLAMA_NAMESPACE = "library"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
MAX_MANIFEST_BYTES = 1 << 20  # real manifests are under 2 KB
MAX_WALK_ENTRIES = 50_000  # directory entries one scan of one store may visit
DEFAULT_QUANT = "Q4_K_M"  # what llama.cpp's -hf picks when a repo holds several

_NAME_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class StoreRoots:
    """Where each store lives on this machine. Several roots are searched in order."""

    ollama: tuple[Path, ...] = ()
    lmstudio: tuple[Path, ...] = ()
    hf_hub: tuple[Path, ...] = ()
    llama_cache: tuple[Path, ...] = ()
    hf_endpoint: str | None = None  # for downloads; None means huggingface_hub's default
    cache_dir: Path | None = None  # specrun's own cache, where the vocabulary fingerprints are kept


def roots_from_env(env: Mapping[str, str] | None = None, home: Path | None = None) -> StoreRoots:
    """The stores' folders as Ollama, LM Studio, huggingface_hub and llama.cpp find them.

    ``OLLAMA_MODELS`` (else ``~/.ollama/models`` and the Linux service's
    ``/usr/share/ollama/.ollama/models``); ``LMSTUDIO_MODELS`` (specrun's own override, else
    ``~/.lmstudio/models`` and the older ``~/.cache/lm-studio/models``); ``HF_HUB_CACHE``, else
    ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``; ``LLAMA_CACHE``, else
    ``$XDG_CACHE_HOME/llama.cpp`` (``~/Library/Caches/llama.cpp`` on macOS). Also
    ``HF_ENDPOINT`` for downloads and specrun's own cache (``SPECRUN_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/specrun``).
    """
    env = os.environ if env is None else env
    home = home or Path(env.get("HOME") or os.path.expanduser("~"))

    def path(text: str) -> Path:
        return home / text[2:] if text.startswith("~/") else Path(text)

    xdg_cache = path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else home / ".cache"
    if env.get("OLLAMA_MODELS"):
        ollama: tuple[Path, ...] = (path(env["OLLAMA_MODELS"]),)
    else:
        ollama = (home / ".ollama/models", Path("/usr/share/ollama/.ollama/models"))
    if env.get("LMSTUDIO_MODELS"):
        lmstudio: tuple[Path, ...] = (path(env["LMSTUDIO_MODELS"]),)
    else:
        lmstudio = (home / ".lmstudio/models", home / ".cache/lm-studio/models")
    if env.get("HF_HUB_CACHE"):
        hf_hub = path(env["HF_HUB_CACHE"])
    elif env.get("HF_HOME"):
        hf_hub = path(env["HF_HOME"]) / "hub"
    else:
        hf_hub = xdg_cache / "huggingface/hub"
    if env.get("LLAMA_CACHE"):
        llama = path(env["LLAMA_CACHE"])
    elif sys.platform == "darwin":
        llama = home / "Library/Caches/llama.cpp"
    else:
        llama = xdg_cache / "llama.cpp"
    if env.get("SPECRUN_CACHE_DIR"):
        cache = path(env["SPECRUN_CACHE_DIR"])
    else:
        cache = xdg_cache / "specrun"
    return StoreRoots(ollama, lmstudio, (hf_hub,), (llama,), env.get("HF_ENDPOINT") or None, cache)


# --- references ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Ref:
    """A parsed store reference. ``file`` and ``quant`` are exclusive selectors."""

    store: str  # "ollama" | "lmstudio" | "hf"
    repo: str  # ollama: host/namespace/name; lmstudio: publisher/repo; hf: org/repo
    tag: str | None = None  # ollama only
    file: str | None = None  # a path inside the repo folder
    quant: str | None = None  # e.g. Q4_K_M

    def __str__(self) -> str:
        if self.store == "ollama":
            host, ns, name = self.repo.split("/")
            short = name if (host, ns) == (OLLAMA_HOST, OLLAMA_NAMESPACE) else (f"{ns}/{name}" if host == OLLAMA_HOST else self.repo)
            return f"ollama:{short}:{self.tag}"
        tail = f"/{self.file}" if self.file else (f":{self.quant}" if self.quant else "")
        return f"{self.store}:{self.repo}{tail}"


def is_ref(text: str) -> bool:
    """Does ``text`` start like a store reference (``ollama:``, ``lmstudio:``, ``hf:``)?"""
    head, sep, _ = text.partition(":")
    return bool(sep) and head.lower() in PREFIXES


def _bad_ref(text: str, why: str, example: str) -> InputError:
    return UnknownModel(f"{text!r} is not a valid reference: {why}", f"write it like {example}")


def _check_parts(text: str, parts: list[str], example: str) -> None:
    for p in parts:
        if not _NAME_PART.fullmatch(p) or p in (".", ".."):
            raise _bad_ref(text, f"{p!r} is not a name", example)


def parse_ref(text: str) -> Ref:
    """Parse ``ollama:...``, ``lmstudio:...`` or ``hf:...``. Raises UnknownModel when malformed."""
    head, _, rest = text.partition(":")
    store = head.lower()
    if store == "ollama":
        example = "ollama:llama3.1:8b or ollama:namespace/model:tag"
        name, tag = rest, "latest"
        if ":" in rest.rsplit("/", 1)[-1]:
            name, tag = rest.rsplit(":", 1)
        parts = name.split("/")
        if not name or len(parts) > 3:
            raise _bad_ref(text, "expected [host/][namespace/]model[:tag]", example)
        _check_parts(text, [*parts, tag], example)
        host, ns = OLLAMA_HOST, OLLAMA_NAMESPACE
        if len(parts) == 2:
            ns = parts[0]
        elif len(parts) == 3:
            host, ns = parts[0], parts[1]
        return Ref("ollama", f"{host}/{ns}/{parts[-1]}", tag=tag)
    if store in ("lmstudio", "hf"):
        owner = "publisher" if store == "lmstudio" else "org"
        example = f"{store}:{owner}/repo, {store}:{owner}/repo:Q4_K_M or {store}:{owner}/repo/file.gguf"
        body, quant = rest, None
        if ":" in rest:
            body, quant = rest.rsplit(":", 1)
            if "/" in quant or not quant:
                raise _bad_ref(text, "a quant selector comes last, after the repo", example)
            _check_parts(text, [quant], example)
        parts = body.split("/")
        if len(parts) < 2:
            raise _bad_ref(text, f"expected {owner}/repo", example)
        _check_parts(text, parts, example)
        file = "/".join(parts[2:]) or None
        if file and quant:
            raise _bad_ref(text, "name a file or a quant, not both", example)
        if file and not file.lower().endswith(".gguf"):
            raise _bad_ref(text, "a file inside the repo must end in .gguf", example)
        return Ref(store, "/".join(parts[:2]), file=file, quant=quant)
    raise _bad_ref(text, f"unknown store {head!r}", "ollama:NAME, lmstudio:PUBLISHER/REPO or hf:ORG/REPO")


# --- choosing a GGUF among a repo's files -------------------------------------------------


def split_info(name: str) -> tuple[str, int, int] | None:
    """``(prefix, index, count)`` for ``prefix-0000i-of-0000n.gguf``, else None."""
    m = _SPLIT.match(name)
    return (m["prefix"], int(m["index"]), int(m["count"])) if m else None


def split_parts(first: Path) -> list[Path]:
    """All parts of a split GGUF, from the path of any part (just ``[first]`` if unsplit)."""
    info = split_info(first.name)
    if info is None:
        return [first]
    prefix, _, count = info
    return [first.with_name(f"{prefix}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def model_file(path: Path) -> Path:
    """``path``, or the first part of a split model stored as ``<stem>-00001-of-0000N.gguf``."""
    if path.exists() or path.suffix.lower() != ".gguf":
        return path
    try:
        firsts = sorted(path.parent.glob(f"{glob_escape(path.stem)}-00001-of-[0-9][0-9][0-9][0-9][0-9].gguf"))
    except OSError:
        return path
    return firsts[0] if firsts else path


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def _quant_pattern(quant: str) -> re.Pattern[str]:
    # Q4_K_M matches model-Q4_K_M.gguf, model.q4_k_m.gguf, Q4_K_M/part-00001-of-00002.gguf,
    # but not IQ4_K_M or Q4_K_M_L
    return re.compile(rf"(?<![A-Za-z0-9_]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)


def is_projector(name: str) -> bool:
    """Multimodal projectors (``mmproj-*.gguf``) sit beside models but cannot generate text."""
    return Path(name).name.lower().startswith("mmproj")


def group_models(names: Iterable[str]) -> dict[str, list[str]]:
    """Repo-relative ``.gguf`` paths grouped into models: the key is the first part's path,
    the value every part in order (one element for an unsplit file)."""
    groups: dict[str, list[str]] = {}
    splits: dict[tuple[str, int], dict[int, str]] = {}
    for n in sorted(set(names)):
        if not n.lower().endswith(".gguf"):
            continue
        info = split_info(n)
        if info is None:
            groups[n] = [n]
        else:
            prefix, index, count = info
            splits.setdefault((prefix, count), {})[index] = n
    for (prefix, count), parts in splits.items():
        first = f"{prefix}-{1:05d}-of-{count:05d}.gguf"
        groups[first] = [parts.get(i, f"{prefix}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    return dict(sorted(groups.items()))


def pick_model(names: Iterable[str], ref: Ref, where: str) -> list[str]:
    """The files of the one model ``ref`` selects among a repo's ``.gguf`` paths: a named
    file, the one matching ``:QUANT``, the only model, or Q4_K_M as llama.cpp's -hf picks."""
    groups = group_models(names)
    models = {k: v for k, v in groups.items() if not is_projector(k)}
    if ref.file:
        for parts in groups.values():
            if ref.file in parts:
                return parts
        raise UnknownModel(f"{ref}: no file {ref.file!r} in {where}", _choices(models, ref))
    if ref.quant:
        pat = _quant_pattern(ref.quant)
        hits = {k: v for k, v in models.items() if pat.search(k)}
        if len(hits) == 1:
            return next(iter(hits.values()))
        if not hits:
            raise UnknownModel(f"{ref}: no {ref.quant} GGUF in {where}", _choices(models, ref))
        raise UnknownModel(f"{ref}: {len(hits)} files match {ref.quant} in {where}", _choices(hits, ref))
    if len(models) == 1:
        return next(iter(models.values()))
    if not models:
        raise UnknownModel(f"{ref}: no GGUF model in {where}", "check the name, or download it first")
    default = {k: v for k, v in models.items() if _quant_pattern(DEFAULT_QUANT).search(k)}
    if len(default) == 1:
        return next(iter(default.values()))
    raise UnknownModel(f"{ref}: {where} holds {len(models)} GGUF models", _choices(models, ref))


def _choices(models: Mapping[str, list[str]], ref: Ref, limit: int = 6) -> str:
    if not models:
        return "the repo holds no GGUF model"
    names = list(models)
    shown = ", ".join(f"{ref.store}:{ref.repo}/{n}" for n in names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"name one: {shown}{more}"


# --- resolving a reference to a file ------------------------------------------------------


def resolve_ref(text: str, roots: StoreRoots) -> Path:
    """The GGUF file a store reference names (for a split model, its first part)."""
    ref = parse_ref(text)
    if ref.store == "ollama":
        return _resolve_ollama(ref, roots.ollama)
    if ref.store == "lmstudio":
        return _resolve_lmstudio(ref, roots.lmstudio)
    return _resolve_hf(ref, roots)


def _existing(roots: Iterable[Path]) -> list[Path]:
    out = []
    for r in roots:
        try:
            if r.is_dir():
                out.append(r)
        except OSError:
            continue
    return out


def _resolve_ollama(ref: Ref, roots: tuple[Path, ...]) -> Path:
    assert ref.tag is not None
    found = _existing(roots)
    for root in found:
        manifest = _find_ollama_manifest(root / "manifests", ref)
        if manifest is not None:
            return ollama_model_blob(root, manifest, str(ref))
    where = ", ".join(str(r) for r in roots) or "(no folder)"
    return _missing(ref, f"no Ollama manifest for {ref} under {where}", f"`ollama pull {str(ref)[len('ollama:') :]}`, or set OLLAMA_MODELS")


def _find_ollama_manifest(manifests: Path, ref: Ref) -> Path | None:
    assert ref.tag is not None
    exact = manifests.joinpath(*ref.repo.split("/"), ref.tag)
    if exact.is_file():
        return exact
    # Ollama's names ignore case on some systems: walk the four levels case-insensitively
    here = manifests
    for part in [*ref.repo.split("/"), ref.tag]:
        try:
            entries = {e.name.lower(): e for e in os.scandir(here)}
        except OSError:
            return None
        e = entries.get(part.lower())
        if e is None:
            return None
        here = Path(e.path)
    return here if here.is_file() else None


def read_manifest(path: Path) -> dict:
    """An Ollama manifest as a dict, bounded and checked; InputError if it is not one."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise InputError(f"cannot read Ollama manifest {path}: {e.strerror or e}", "check the file's permissions") from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise InputError(f"Ollama manifest {path} is over {MAX_MANIFEST_BYTES} bytes: not a manifest", "re-pull the model with ollama")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise InputError(f"Ollama manifest {path} is malformed: {e}", "re-pull the model with ollama") from None
    if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
        raise InputError(f"Ollama manifest {path} is malformed: no list of layers", "re-pull the model with ollama")
    if data.get("schemaVersion") != 2:
        raise InputError(f"Ollama manifest {path} has schemaVersion {data.get('schemaVersion')!r}, not 2", "update Ollama and re-pull")
    return data


def ollama_model_blob(root: Path, manifest: Path, label: str) -> Path:
    """The blob of a manifest's model layer, checked to exist and have the manifest's size."""
    data = read_manifest(manifest)
    types = []
    for layer in data["layers"]:
        if not isinstance(layer, dict):
            raise InputError(f"Ollama manifest {manifest} is malformed: a layer is not an object", "re-pull the model with ollama")
        types.append(str(layer.get("mediaType")))
        if layer.get("mediaType") != OLLAMA_MODEL_LAYER:
            continue
        digest = layer.get("digest")
        m = _DIGEST.fullmatch(digest) if isinstance(digest, str) else None
        if m is None:
            raise InputError(
                f"Ollama manifest {manifest}: the model layer's digest {digest!r} is not sha256:<64 hex>", "re-pull the model with ollama"
            )
        blob = root / "blobs" / f"sha256-{m[1]}"
        if not os.path.lexists(blob) and os.path.lexists(root / "blobs" / f"sha256:{m[1]}"):
            blob = root / "blobs" / f"sha256:{m[1]}"  # older Ollama on Linux
        try:
            size = blob.stat().st_size
        except (OSError, RuntimeError):
            raise InputError(
                f"{label}: the model blob {blob.name} named by {manifest} is missing (a dangling blob)",
                "re-pull the model with ollama",
            ) from None
        want = layer.get("size")
        if isinstance(want, int) and want != size:
            raise InputError(f"{label}: the model blob {blob} has {size} bytes, the manifest says {want}", "re-pull the model with ollama")
        return blob
    raise InputError(
        f"{label}: manifest {manifest} has no GGUF model layer (layers: {', '.join(types) or 'none'})",
        "only Ollama models with a GGUF weights layer can be used",
    )


def _resolve_lmstudio(ref: Ref, roots: tuple[Path, ...]) -> Path:
    for root in _existing(roots):
        folder = root.joinpath(*ref.repo.split("/"))
        if folder.is_dir():
            names = [str(p.relative_to(folder).as_posix()) for p in _walk(folder, max_depth=3)]
            parts = pick_model(names, ref, str(folder))
            return _check_parts_exist(str(ref), [folder / p for p in parts])
    where = ", ".join(str(r) for r in roots) or "(no folder)"
    return _missing(ref, f"no LM Studio folder {ref.repo} under {where}", "download it in LM Studio, or set LMSTUDIO_MODELS")


def _hf_repo_dirs(ref: Ref, roots: StoreRoots) -> Iterator[Path]:
    org, repo = ref.repo.split("/")
    for root in _existing([*roots.hf_hub, *roots.llama_cache]):
        d = root / f"models--{org}--{repo}"
        if os.path.lexists(d):
            yield d


def hf_snapshot(repo_dir: Path) -> Path:
    """The snapshot ``refs/main`` points to (else the newest one), checked for link loops."""
    label = repo_dir.name
    main = repo_dir / "refs" / "main"
    commit = None
    try:
        if os.path.lexists(main):
            with open(main, encoding="ascii") as f:
                commit = f.read(100).strip()
            if not _COMMIT.fullmatch(commit):
                raise InputError(f"{main} does not hold a commit hash", "re-download the model with huggingface_hub")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {main}: {getattr(e, 'strerror', None) or e}", "re-download the model with huggingface_hub") from None
    snaps = repo_dir / "snapshots"
    if commit is None:
        try:
            found = sorted((e.stat().st_mtime, e.path) for e in os.scandir(snaps) if e.is_dir())
        except OSError:
            found = []
        if not found:
            raise InputError(f"{label} in the Hugging Face cache has no snapshot", "re-download the model with huggingface_hub")
        snap = Path(found[-1][1])
    else:
        snap = snaps / commit
    try:
        os.stat(snap)
    except OSError as e:
        raise InputError(
            f"{label}: snapshot {snap.name} is unreadable: {e.strerror or e}", "re-download the model with huggingface_hub"
        ) from None
    return snap


def _resolve_hf(ref: Ref, roots: StoreRoots) -> Path:
    for d in _hf_repo_dirs(ref, roots):
        snap = hf_snapshot(d)
        names = [str(p.relative_to(snap).as_posix()) for p in _walk(snap, max_depth=4)]
        parts = pick_model(names, ref, f"{d.name} (Hugging Face cache)")
        return _check_parts_exist(str(ref), [snap / p for p in parts])
    # llama.cpp's older -hf cache: flat files named <org>_<repo>_<file>.gguf
    org, repo = ref.repo.split("/")
    prefix = f"{org}_{repo}_"
    for root in _existing(roots.llama_cache):
        names = [p.name[len(prefix) :] for p in _walk(root, max_depth=1) if p.name.startswith(prefix)]
        if names:
            parts = pick_model(names, ref, f"{root} (llama.cpp cache)")
            return _check_parts_exist(str(ref), [root / (prefix + p) for p in parts])
    where = ", ".join(str(r) for r in (*roots.hf_hub, *roots.llama_cache))
    return _missing(ref, f"{ref} is not in the Hugging Face cache ({where})", f"`specrun pull {ref}`, or set HF_HUB_CACHE")


def _check_parts_exist(label: str, parts: list[Path]) -> Path:
    for p in parts:
        try:
            p.resolve(strict=True)
            if not p.is_file():
                raise InputError(f"{label}: {p} is not a file", "re-download the model")
        except RuntimeError:  # Python < 3.13 raises this for a symlink loop
            raise InputError(f"{label}: {p} is a symlink loop", "delete it and re-download the model") from None
        except OSError as e:
            if e.errno == 40:  # ELOOP on 3.13+
                raise InputError(f"{label}: {p} is a symlink loop", "delete it and re-download the model") from None
            what = "a dangling link (incomplete download?)" if os.path.islink(p) else "missing"
            part = " part" if len(parts) > 1 else ""
            raise InputError(f"{label}: the GGUF{part} {p} is {what}", "re-download the model") from None
    return parts[0]


def _missing(ref: Ref, message: str, how: str) -> Path:
    raise UnknownModel(message, f"get it with {how}")


# --- scanning -----------------------------------------------------------------------------


@dataclass
class Found:
    """A GGUF file found in a store: the references that reach it, or why it is unusable."""

    ref: str
    store: str  # "ollama" | "lmstudio" | "hf" | "llama.cpp" | "registry"
    path: Path | None
    parts: int = 1
    error: str | None = None


@dataclass
class ScanLimits:
    max_entries: int = MAX_WALK_ENTRIES
    truncated: list[str] = field(default_factory=list)


def _walk(top: Path, max_depth: int, limits: ScanLimits | None = None) -> Iterator[Path]:
    """``.gguf`` paths under ``top``, at most ``max_depth`` folders deep, never following
    links to folders, visiting at most ``limits.max_entries`` entries."""
    budget = limits.max_entries if limits else MAX_WALK_ENTRIES
    stack: list[tuple[Path, int]] = [(top, 0)]
    while stack:
        folder, depth = stack.pop()
        try:
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            continue
        for e in entries:
            budget -= 1
            if budget < 0:
                if limits is not None:
                    limits.truncated.append(str(top))
                return
            try:
                if e.is_dir(follow_symlinks=False):
                    if depth < max_depth and not e.name.startswith("."):
                        stack.append((Path(e.path), depth + 1))
                    continue
            except OSError:
                continue
            if e.name.lower().endswith(".gguf"):
                yield Path(e.path)


def scan_stores(roots: StoreRoots, limits: ScanLimits | None = None) -> list[Found]:
    """Every GGUF model in the stores, one entry per reference (split models once, by their
    first part; projectors skipped). Broken entries are returned with ``error`` set."""
    limits = limits or ScanLimits()
    found: list[Found] = []
    found += _scan_ollama(roots, limits)
    found += _scan_lmstudio(roots, limits)
    found += _scan_hf(roots, limits)
    found += _scan_llama_cache(roots, limits)
    return found


def _scan_ollama(roots: StoreRoots, limits: ScanLimits) -> list[Found]:
    out = []
    for root in _existing(roots.ollama):
        manifests = root / "manifests"
        for host in _dirs(manifests):
            for ns in _dirs(host):
                for name in _dirs(ns):
                    for tag in _files(name):
                        ref = str(Ref("ollama", f"{host.name}/{ns.name}/{name.name}", tag=tag.name))
                        try:
                            out.append(Found(ref, "ollama", ollama_model_blob(root, tag, ref)))
                        except InputError as e:
                            out.append(Found(ref, "ollama", None, error=str(e)))
                        if len(out) > limits.max_entries:
                            limits.truncated.append(str(manifests))
                            return out
    return out


def _dirs(p: Path) -> list[Path]:
    try:
        return sorted(Path(e.path) for e in os.scandir(p) if e.is_dir(follow_symlinks=False) and not e.name.startswith("."))
    except OSError:
        return []


def _files(p: Path) -> list[Path]:
    try:
        return sorted(Path(e.path) for e in os.scandir(p) if e.is_file() and not e.name.startswith("."))
    except OSError:
        return []


def _grouped(paths: Iterable[Path], base: Path) -> list[tuple[str, list[Path]]]:
    rel = {p.relative_to(base).as_posix(): p for p in paths}
    out = []
    for first, parts in group_models(rel).items():
        if not is_projector(first):
            out.append((first, [base / q for q in parts]))
    return out


def _scan_lmstudio(roots: StoreRoots, limits: ScanLimits) -> list[Found]:
    out = []
    for root in _existing(roots.lmstudio):
        for first, parts in _grouped(_walk(root, 4, limits), root):
            if first.count("/") < 2:
                continue  # LM Studio keeps models as publisher/repo/file
            out.append(_found(f"lmstudio:{first}", "lmstudio", parts))
    return out


def _scan_hf(roots: StoreRoots, limits: ScanLimits) -> list[Found]:
    out = []
    for root in _existing([*roots.hf_hub, *roots.llama_cache]):
        for d in _dirs(root):
            if not d.name.startswith("models--") or d.name.count("--") != 2:
                continue
            _, org, repo = d.name.split("--")
            try:
                snap = hf_snapshot(d)
            except InputError as e:
                out.append(Found(f"hf:{org}/{repo}", "hf", None, error=str(e)))
                continue
            for first, parts in _grouped(_walk(snap, 4, limits), snap):
                out.append(_found(f"hf:{org}/{repo}/{first}", "hf", parts))
    return out


def _scan_llama_cache(roots: StoreRoots, limits: ScanLimits) -> list[Found]:
    out = []
    for root in _existing(roots.llama_cache):
        for _first, parts in _grouped(_walk(root, 0, limits), root):
            out.append(_found(str(parts[0]), "llama.cpp", parts))
    return out


def _found(ref: str, store: str, parts: list[Path]) -> Found:
    try:
        return Found(ref, store, _check_parts_exist(ref, parts), parts=len(parts))
    except InputError as e:
        return Found(ref, store, None, parts=len(parts), error=str(e))
