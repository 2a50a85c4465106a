"""models.toml: the registry of named models, their aliases and default drafts.

An entry::

    [models."qwen-1.5b"]        # quote names that contain dots
    path = "${SPECRUN_MODELS_DIR:-~/.cache/specrun/models}/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    aliases = ["demo"]          # optional
    draft = "qwen-0.5b"         # optional: the default draft for this target
    sha256 = "cc32..."          # optional: checked by `specrun models --verify` and `specrun pull`
    hf = "org/repo/file.gguf"   # optional: where `specrun pull` downloads it from (or org/repo:QUANT)
    source = "how to get it"    # optional: shown when the file is missing
    notes = "free text"         # optional

Paths: ``~``, ``$VAR``, ``${VAR}`` and ``${VAR:-default}`` are expanded (never evaluated by a
shell); a relative path resolves against the folder of the toml file that names it. A path may
also be a store reference (``ollama:qwen2.5-coder:32b``, ``lmstudio:...``, ``hf:...``; see
:mod:`specrun.stores`), resolved when the model is used. A path ``X.gguf`` that is missing
while ``X-00001-of-0000N.gguf`` exists names that split model.

Files: the packaged registry, then one user file laid over it: ``--registry FILE``, else
``$SPECRUN_REGISTRY``, else ``$XDG_CONFIG_HOME/specrun/models.toml`` (``~/.config/...``) if it
exists. A user entry replaces a packaged entry of the same name; a user alias shadows a
packaged one. Unknown keys, and one alias on two entries of the same file (ignoring case, as
lookups do), are errors naming the file and line.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import os
import re
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from specrun.errors import RegistryError, SpecrunError, UnknownModel
from specrun.models.stores import StoreRoots, is_ref, model_file, parse_ref, resolve_ref, roots_from_env

ALLOWED_KEYS = {"path", "aliases", "draft", "sha256", "source", "notes", "hf"}
_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")


def expand(text: str, base: Path, env: dict | None = None) -> Path:
    """Expand ~ and $VARS (with ${VAR:-default}) and resolve against ``base``. No shell."""
    env = os.environ if env is None else env

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        if name in env and (env[name] or m.group(2) is None):
            return env[name]
        if m.group(2) is not None:
            return m.group(2)
        return m.group(0)

    p = Path(os.path.expanduser(_VAR.sub(sub, text)))
    p = Path(os.path.expanduser(str(p)))  # a default may itself start with ~
    return p if p.is_absolute() else (base / p)


@dataclass
class Entry:
    name: str
    path: Path
    aliases: list[str] = field(default_factory=list)
    draft: str | None = None
    sha256: str | None = None
    source: str | None = None
    notes: str | None = None
    origin: Path | None = None
    ref: str | None = None  # a store reference given as the path (then ``path`` is its text)
    hf: str | None = None  # org/repo/file.gguf or org/repo:QUANT, for `specrun pull`

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "path": str(self.path),
            "ref": self.ref,
            "hf": self.hf,
            "aliases": self.aliases,
            "draft": self.draft,
            "sha256": self.sha256,
            "source": self.source,
            "notes": self.notes,
            "origin": str(self.origin) if self.origin else None,
        }


@dataclass
class Resolved:
    """A model named on the command line: a registry entry, a store reference or a bare path."""

    path: Path
    entry: Entry | None = None
    ref: str | None = None

    @property
    def label(self) -> str:
        return self.entry.name if self.entry else (self.ref or self.path.name)


def packaged_registry_path() -> Path:
    return Path(str(resources.files("specrun").joinpath("models.toml")))


def user_config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "specrun" / "models.toml"


def _load_file(path: Path) -> dict[str, Entry]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RegistryError(f"registry file not found: {path}", "check {registry} / SPECRUN_REGISTRY") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RegistryError(f"cannot read registry {path}: {e}", "check the file") from None
    try:
        data = _toml(text)
    except tomllib.TOMLDecodeError as e:
        raise RegistryError(f"{path} is not valid TOML: {e}", "fix that line") from None
    extra = set(data) - {"models"}
    if extra:
        raise RegistryError(
            f"{path}: unknown top-level key(s) {', '.join(sorted(extra))}",
            "entries go under [models.NAME]",
        )
    models = data.get("models", {})
    if not isinstance(models, dict):
        raise RegistryError(f"{path}: 'models' must be a table", "write entries as [models.NAME]")
    base = path.parent
    entries: dict[str, Entry] = {}
    alias_owner: dict[str, str] = {}
    for name, raw in models.items():

        def where(name: str = name) -> str:  # found only for a message: a registry's lines are many
            return f"{_at(path, text, name)}: [models.{name}]"

        if not isinstance(raw, dict):
            raise RegistryError(f"{where()} must be a table", "write it as [models.NAME] with path = ...")
        unknown = set(raw) - ALLOWED_KEYS
        nested = [k for k in unknown if isinstance(raw[k], dict)]
        if nested:
            raise RegistryError(
                f"{where()} is split at a dot into sub-tables ({', '.join(sorted(nested))})",
                f'quote a name that contains dots: [models."{name}.{nested[0]}"]',
            )
        if unknown:
            raise RegistryError(
                f"{_at(path, text, name, min(unknown))}: [models.{name}] has unknown key(s) {', '.join(sorted(unknown))}",
                f"allowed keys are {', '.join(sorted(ALLOWED_KEYS))}",
            )
        if not isinstance(raw.get("path"), str) or not raw["path"]:
            raise RegistryError(f'{where()} needs a path = "..." string', "add the .gguf path")
        aliases = raw.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
            raise RegistryError(f"{where()}: aliases must be a list of strings", 'e.g. aliases = ["8b"]')
        for key in ("draft", "sha256", "source", "notes", "hf"):
            if key in raw and not isinstance(raw[key], str):
                raise RegistryError(f"{where()}: {key} must be a string", f'write {key} = "..."')
        sha = raw.get("sha256")
        if sha is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", sha):
            raise RegistryError(f"{where()}: sha256 must be 64 hex digits", "copy it from sha256sum")
        for a in [name, *aliases]:  # lookups ignore case, so clashes do too
            owner = alias_owner.setdefault(a.lower(), name)
            if owner != name:
                raise RegistryError(
                    f"{_at(path, text, name, 'aliases')}: the name {a!r} is used by both [models.{owner}] and [models.{name}]",
                    "give each alias to one entry only",
                )
        ref = raw["path"] if is_ref(raw["path"]) else None
        hf = raw.get("hf")
        for key, value in (("path", ref), ("hf", hf and (hf if hf.startswith("hf:") else f"hf:{hf}"))):
            if value is None:
                continue
            try:
                parse_ref(value)
            except SpecrunError as e:
                raise RegistryError(f"{_at(path, text, name, key)}: [models.{name}] {key}: {e.message}", e.fix) from None
        if (hf or (ref and ref.startswith("hf:"))) and not raw.get("source"):
            raw = {**raw, "source": f"specrun pull {name}"}
        entries[name] = Entry(
            name=name,
            path=Path(ref) if ref else expand(raw["path"], base),
            aliases=list(aliases),
            draft=raw.get("draft"),
            sha256=sha.lower() if sha else None,
            source=raw.get("source"),
            notes=raw.get("notes"),
            origin=path,
            ref=ref,
            hf=hf.removeprefix("hf:") if hf else None,
        )
    return entries


@functools.lru_cache(maxsize=8)
def _toml(text: str) -> dict:
    """A registry's TOML, parsed once per text (read-only: callers copy what they change): a
    process that runs many commands, as the tests and the fuzzer do, reads the same file each time."""
    return tomllib.loads(text)


def _at(path: Path, text: str, name: str, key: str | None = None) -> str:
    """``path:line`` of ``[models.NAME]``, or of ``KEY =`` inside that table, for error messages."""
    q = re.escape(name)
    header = re.compile(rf"""\s*\[\s*models\s*\.\s*(?:"{q}"|'{q}'|{q})\s*\]""")
    lines = text.splitlines()
    for i, row in enumerate(lines):
        if not header.match(row):
            continue
        if key:
            for j in range(i + 1, len(lines)):
                if lines[j].lstrip().startswith("["):  # the next table
                    break
                if re.match(rf"""\s*["']?{re.escape(key)}["']?\s*=""", lines[j]):
                    return f"{path}:{j + 1}"
        return f"{path}:{i + 1}"
    return str(path)


class Registry:
    def __init__(self, entries: dict[str, Entry], files: list[Path], roots: StoreRoots | None = None):
        self.entries = entries
        self.files = files
        self.roots = roots or StoreRoots()
        self._names: dict[str, str] = {}
        # packaged entries first, so a user file's names shadow them
        for e in entries.values():
            for n in (e.name, *e.aliases):
                self._names[n.lower()] = e.name
        for e in entries.values():  # canonical names always win over aliases
            self._names[e.name.lower()] = e.name

    @classmethod
    def load(cls, user_file: str | os.PathLike | None = None, roots: StoreRoots | None = None) -> Registry:
        """The packaged registry with the user's file over it; store references resolve
        against ``roots`` (default: the stores' folders from the environment)."""
        files = [packaged_registry_path()]
        if user_file:
            files.append(Path(user_file))
        elif os.environ.get("SPECRUN_REGISTRY"):
            files.append(Path(os.environ["SPECRUN_REGISTRY"]))
        elif user_config_path().exists():
            files.append(user_config_path())
        entries: dict[str, Entry] = {}
        for f in files:
            layer = _load_file(f)
            if entries:  # a user file: its names shadow packaged aliases
                taken = {n.lower() for e in layer.values() for n in (e.name, *e.aliases)}
                for e in entries.values():
                    e.aliases = [a for a in e.aliases if a.lower() not in taken]
            entries.update(layer)
        return cls(entries, files, roots or roots_from_env())

    def get(self, name: str) -> Entry | None:
        key = self._names.get(name.lower())
        return self.entries[key] if key else None

    def locate(self, entry: Entry) -> Path:
        """The file an entry names now: its store reference resolved (InputError if that
        fails), or its path (the first part, for a model stored split)."""
        if entry.ref:
            return resolve_ref(entry.ref, self.roots)
        return model_file(entry.path)

    def resolve(self, name: str) -> Resolved:
        """A registry name or alias, a store reference (ollama:, lmstudio:, hf:) or a path to a .gguf file."""
        entry = self.get(name)
        if entry is not None:
            return Resolved(self.locate(entry), entry, entry.ref)
        if is_ref(name):
            return Resolved(resolve_ref(name, self.roots), ref=name)
        looks_like_path = name.endswith(".gguf") or os.sep in name or "/" in name
        p = Path(os.path.expanduser(name))
        if looks_like_path or p.exists():
            return Resolved(p.resolve() if p.exists() else p)
        choices = sorted(self._names)
        close = difflib.get_close_matches(name.lower(), choices, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else "run `specrun models` to list names"
        raise UnknownModel(f"unknown model {name!r}: not a registry name, alias, store reference or .gguf path", hint)

    def default_draft(self, target: Resolved) -> Resolved | None:
        if target.entry and target.entry.draft:
            return self.resolve(target.entry.draft)
        return None


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()
