"""Every GGUF on this machine that specrun can name, and what its header says, cached.

A :class:`Summary` holds the header facts that ``models --scan``, draft discovery and the
memory estimate read, and two hashes of the vocabulary:

* ``texts_hash``: the token texts from ``compat.VOCAB_CHECK_START_ID`` up, the range the
  token-text rule compares; equal hashes and sizes mean that rule passes without reading
  either file again;
* ``fingerprint``: everything the vocabulary rules compare (tokenizer model, every token
  text, special ids, add_bos/add_eos); two files with the same fingerprint are compatible.

Reading a 150k-token header costs tens of milliseconds, so summaries are kept in one JSON
file keyed by the file's real path, size and mtime: a changed or replaced file is read again.
The first differing token texts of two vocabularies (the detail check-pair prints) are kept
there too, keyed by both text hashes, so a near miss is read once, not on every run.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from specrun.errors import InputError, SpecrunError
from specrun.gguf.facts import ModelFacts, ModelInfo, model_info
from specrun.gguf.header import read_header
from specrun.gguf.heads import MTP_ARCHS, HeadFile, Heads, head_file_of, heads_of
from specrun.gguf.vocabulary import VOCAB_CHECK_START_ID, first_token_differences
from specrun.models.registry import Registry
from specrun.models.stores import Found, ScanLimits, StoreRoots, scan_stores, split_parts

CACHE_FILE = "vocab-fingerprints.json"
CACHE_VERSION = 1
CACHE_MAX_ENTRIES = 5000  # oldest dropped beyond this


@dataclass(frozen=True, kw_only=True)
class Summary(ModelFacts):
    """A header's facts as a catalog keeps them (``file_size``, ``n_params`` and
    ``weights_bytes`` count every part of a split model), with the vocabulary's hashes."""

    texts_hash: str
    fingerprint: str
    mtp_heads: int = 0  # built-in MTP heads (heads.py), their weights and KV bytes per position
    mtp_bytes: int = 0
    mtp_kv_per_token: int = 0
    draft_head: HeadFile | None = None  # a draft head in a file of its own: the target it is for (heads.py)

    @property
    def heads(self) -> Heads:
        return Heads(
            self.architecture,
            self.mtp_heads,
            self.n_layer - self.mtp_heads,
            self.mtp_bytes,
            self.mtp_kv_per_token,
            self.architecture in MTP_ARCHS,
        )

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["path"] = str(self.path)
        out["draft_head"] = self.draft_head.to_json() if self.draft_head is not None else None
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Summary:
        names = {f.name for f in fields(cls)}
        if set(d) != names:
            raise ValueError("fields differ")
        h = d["draft_head"]
        return cls(**{**d, "path": Path(d["path"]), "draft_head": HeadFile.from_json(h) if h is not None else None})


def _token_bytes(tokens: Any, start: int, end: int) -> bytes:
    if hasattr(tokens, "raw_span"):  # a StringArray straight from the file
        return bytes(tokens.raw_span(start, end)) if start < end else b""
    return b"".join(len(b).to_bytes(8, "little") + b for b in (t.encode("utf-8", "surrogateescape") for t in tokens[start:end]))


def fingerprint(m: ModelInfo) -> str:
    """Everything the vocabulary rules compare (tokenizer model, every token text, special ids,
    add_bos/add_eos), hashed: two headers with the same fingerprint tokenize alike."""
    fp = hashlib.sha256()
    facts = [m.tokenizer_model, m.n_vocab, m.bos_id, m.eos_id, m.eot_id, m.pad_id, m.add_bos, m.add_eos]
    fp.update(json.dumps(facts).encode())
    fp.update(_token_bytes(m.tokens, 0, m.n_vocab))
    return fp.hexdigest()


def summarize(m: ModelInfo, size: int | None = None) -> Summary:
    """The summary of one header; for a split model, the other parts' tensors are added."""
    n = m.n_vocab
    weights, params = m.weights_bytes, m.n_params
    for part in split_parts(m.path)[1:]:
        h = read_header(part)
        weights += sum(t.nbytes for t in h.tensors)
        params += sum(t.n_elements for t in h.tensors)
    heads = heads_of(m)
    texts = hashlib.sha256(_token_bytes(m.tokens, min(VOCAB_CHECK_START_ID, n), n)).hexdigest()
    return Summary(
        **m.facts() | {"file_size": m.file_size if size is None else size, "n_params": params, "weights_bytes": weights},
        texts_hash=texts,
        fingerprint=fingerprint(m),
        mtp_heads=heads.count,
        mtp_bytes=heads.weights_bytes,
        mtp_kv_per_token=heads.kv_bytes_per_token,
        draft_head=head_file_of(m),
    )


def _stat_key(path: Path) -> tuple[str, str]:
    """(real path, "size:mtime_ns" of every part): the cache key and its validity stamp."""
    real = os.path.realpath(path)
    stamps = []
    for p in split_parts(path):  # the parts sit beside the name, not beside a cache blob
        st = os.stat(p)
        stamps.append(f"{st.st_size}:{st.st_mtime_ns}")
    return real, ",".join(stamps)


class SummaryCache:
    """Header summaries by (path, size, mtime), in memory and in ``<cache_dir>/vocab-fingerprints.json``."""

    def __init__(self, cache_dir: Path | None):
        self.file = cache_dir / CACHE_FILE if cache_dir else None
        self._entries: dict[str, dict[str, Any]] = {}
        self._diffs: dict[str, list[list[Any]]] = {}
        self._infos: dict[str, ModelInfo] = {}
        self.read = 0  # headers parsed by this instance (the rest came from the cache)
        self._dirty = False
        if self.file is not None:
            try:
                data = json.loads(self.file.read_text(encoding="utf-8"))
                if isinstance(data, dict) and data.get("version") == CACHE_VERSION and isinstance(data.get("files"), dict):
                    self._entries = data["files"]
                    self._diffs = data.get("diffs") or {}
            except (OSError, ValueError):
                pass  # no cache, or a damaged one: start afresh

    def get(self, path: Path) -> Summary:
        """The summary of the GGUF at ``path`` (the first part of a split model). Raises
        InputError for a file that cannot be read or is not GGUF, also when cached."""
        try:
            key, stamp = _stat_key(path)
        except (OSError, RuntimeError) as e:
            raise InputError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}", "check the path") from None
        hit = self._entries.get(key)
        if hit is not None and hit.get("stamp") == stamp:
            if "error" in hit:
                raise InputError(str(hit["error"]))
            try:
                return replace(Summary.from_json(hit["summary"]), path=path)
            except (KeyError, TypeError, ValueError):
                pass  # an entry from another version: read the file again
        try:
            size = sum(int(s.split(":")[0]) for s in stamp.split(","))
            s = summarize(self.info(path), size)
        except SpecrunError as e:
            self._put(key, {"stamp": stamp, "error": str(e)})
            raise
        self._put(key, {"stamp": stamp, "summary": s.to_json()})
        return s

    def info(self, path: Path) -> ModelInfo:
        """The full header (token texts included), parsed once per instance and real path."""
        key = os.path.realpath(path)
        if key not in self._infos:
            self.read += 1
            self._infos[key] = model_info(path)
        return self._infos[key]

    def token_diffs(self, a: Summary, b: Summary) -> list[tuple[int, str, str]]:
        """``compat.first_token_differences`` for two summarized files, reading neither when
        their compared texts are identical or the pair was compared before."""
        if a.n_vocab == b.n_vocab and a.texts_hash == b.texts_hash:
            return []  # the compared range is byte-identical
        key = f"{a.texts_hash}:{a.n_vocab}|{b.texts_hash}:{b.n_vocab}"
        hit = self._diffs.get(key)
        if hit is None:
            hit = self._diffs[key] = [list(d) for d in first_token_differences(self.info(a.path), self.info(b.path))]
            self._dirty = True
        return [(int(i), str(x), str(y)) for i, x, y in hit]

    def _put(self, key: str, value: dict[str, Any]) -> None:
        self._entries.pop(key, None)
        self._entries[key] = value  # newest last
        self._dirty = True

    def save(self) -> None:
        """Write the cache atomically; a cache that cannot be written is only slower next time."""
        if self.file is None or not self._dirty:
            return
        entries = dict(list(self._entries.items())[-CACHE_MAX_ENTRIES:])
        diffs = dict(list(self._diffs.items())[-CACHE_MAX_ENTRIES:])
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.file.parent, prefix=".vocab-", suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"version": CACHE_VERSION, "files": entries, "diffs": diffs}, f)
            os.replace(tmp, self.file)
            self._dirty = False
        except OSError:
            try:
                os.unlink(tmp)
            except (OSError, UnboundLocalError):
                pass


# --- the catalog: every known GGUF, each file once with all the names that reach it -------


@dataclass
class Known:
    refs: list[str]  # registry names first, then store references
    stores: list[str]
    path: Path | None
    parts: int = 1
    summary: Summary | None = None
    error: str | None = None

    @property
    def label(self) -> str:
        return self.refs[0]

    def to_json(self) -> dict[str, Any]:
        s = self.summary
        return {
            "refs": self.refs,
            "stores": self.stores,
            "path": str(self.path) if self.path else None,
            "parts": self.parts,
            "size": s.file_size if s else None,
            "architecture": s.architecture if s else None,
            "name": s.name if s else None,
            "quant": s.quant if s else None,
            "n_params": s.n_params if s else None,
            "n_vocab": s.n_vocab if s else None,
            "tokenizer": s.tokenizer_model if s else None,
            "fingerprint": s.fingerprint[:16] if s else None,
            "mtp_heads": s.mtp_heads if s else None,
            "draft_head": s.draft_head.to_json() if s and s.draft_head else None,
            "error": self.error,
        }


@dataclass
class Catalog:
    models: list[Known] = field(default_factory=list)
    truncated: list[str] = field(default_factory=list)  # folders whose walk hit the limit
    headers_read: int = 0


def build_catalog(
    registry: Registry, roots: StoreRoots, cache: SummaryCache, limits: ScanLimits | None = None, extra: Sequence[Found] = ()
) -> Catalog:
    """Every GGUF in the registry and the stores (and ``extra``), one row per file (hard links
    and symlinks to one file are one row), summarized through ``cache``."""
    limits = limits or ScanLimits()
    found: list[Found] = list(extra)
    for e in registry.entries.values():
        try:
            p = registry.locate(e)
        except SpecrunError as err:
            if e.ref:  # a store reference that does not resolve is worth showing
                found.append(Found(e.name, "registry", None, error=str(err)))
            continue
        if p.is_file():
            found.append(Found(e.name, "registry", p, parts=len(split_parts(p))))
    found += scan_stores(roots, limits)
    by_file: dict[object, Known] = {}
    rows: list[Known] = []
    for f in found:
        ident: object = ("error", f.ref)
        if f.path is not None:
            try:
                st = os.stat(f.path)
                ident = (st.st_dev, st.st_ino)
            except OSError as err:
                f.error, f.path = f"cannot read {f.path}: {err.strerror or err}", None
        k = by_file.get(ident)
        if k is None:
            k = by_file[ident] = Known([f.ref], [f.store], f.path, f.parts, error=f.error)
            rows.append(k)
        else:
            k.refs.append(f.ref)
            if f.store not in k.stores:
                k.stores.append(f.store)
    for k in rows:
        if k.path is not None and k.error is None:
            try:
                k.summary = cache.get(k.path)
            except SpecrunError as err:
                k.error = str(err)
    cache.save()
    return Catalog(rows, limits.truncated, cache.read)
