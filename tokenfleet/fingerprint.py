"""Fingerprints of a dataset at its first submit, so a later submit cannot silently mix settings.

- **Settings**: what shapes a generation (sampling params, ``on_budget``, tokenizer, format, id field,
  regenerate mode, system prompt), kept as JSON; `settings_changes` names each change, old -> new.
- **Source**: for each record, in order, an 8-byte digest of its sample id, a 4-byte digest of its
  content and its line number (16 bytes a record, stored zlib-compressed and base64-encoded: about 15 MB
  for a million records). `compare_sources` counts the records changed, removed and added and finds the
  first line that differs. Records are read without a tokenizer (only their JSON), so this is one cheap
  pass over the source; a record that is not JSON is left out (the feeder rejects it anyway).
"""

from __future__ import annotations

import base64
import hashlib
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import orjson

from producer.containers import OversizedLine, open_rows
from producer.formats import derive_sample_id
from tokenfleet.config import DatasetConfig

#: One record of a source fingerprint: id digest, content digest, line number.
ENTRY: Final = struct.Struct("<QII")


def settings_of(ds: DatasetConfig) -> dict[str, Any]:
    """The settings of ``ds`` that change what its samples are."""
    return {
        "sampling": dict(ds.sampling),
        "on_budget": ds.on_budget,
        "tokenizer": ds.tokenizer,
        "format": ds.format,
        "id_field": ds.id_field,
        "regenerate": ds.regenerate,
        "system_prompt": ds.system_prompt,
    }


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


#: Settings that change how a generation is streamed to us, not what it is: never a change of settings
#: (older submits stored ``stream_interval`` 8 in the effective sampling).
NOT_SHAPING: Final = frozenset({"sampling.stream_interval"})


def settings_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """``"sampling.max_new_tokens: 256 -> 128"`` for each setting that differs (``unset`` when absent)."""
    a, b = _flat(old), _flat(new)
    for key in NOT_SHAPING:
        a.pop(key, None)
        b.pop(key, None)
    missing = object()
    changes = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, missing), b.get(key, missing)
        if va != vb:
            shown = ["unset" if v is missing else orjson.dumps(v).decode() for v in (va, vb)]
            changes.append(f"{key}: {shown[0]} -> {shown[1]}")
    return changes


def _digest(data: bytes, size: int) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=size).digest(), "little")


def _canonical(obj: Mapping[str, Any]) -> bytes:
    try:
        return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    except TypeError:
        return repr(sorted(obj.items(), key=lambda kv: str(kv[0]))).encode()


def source_fingerprint(path: Path, id_field: str = "id") -> bytes:
    """The fingerprint of the source at ``path``: `ENTRY` per record, in order (first of each id only)."""
    out = bytearray()
    seen: set[int] = set()
    for line_no, data in open_rows(path):
        if isinstance(data, OversizedLine):
            continue
        if isinstance(data, bytes):
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                continue
        else:
            obj = data
        if not isinstance(obj, dict):
            continue
        raw_id = obj.get(id_field)
        sid = str(raw_id) if isinstance(raw_id, str | int) and raw_id != "" else derive_sample_id(obj)
        id_digest = _digest(sid.encode(), 8)
        if id_digest in seen:
            continue
        seen.add(id_digest)
        out += ENTRY.pack(id_digest, _digest(_canonical(obj), 4), line_no)
    return bytes(out)


def encode(fingerprint: bytes) -> str:
    return base64.b64encode(zlib.compress(fingerprint, 6)).decode()


def decode(text: str) -> bytes:
    return zlib.decompress(base64.b64decode(text))


@dataclass(frozen=True, slots=True)
class SourceChange:
    #: Records whose id is in both with other content.
    changed: int
    #: Ids of the old source missing from the new one (with derived ids, an edited line counts here).
    removed: int
    #: Ids new in this source.
    added: int
    #: The first line that differs (in the new source; for a removed record, its old line), or None.
    first_line: int | None

    @property
    def rewrites(self) -> bool:
        """Whether records of the first submit changed or went away (additions alone do not count)."""
        return bool(self.changed or self.removed)

    def describe(self) -> str:
        parts = []
        if self.changed or self.removed:
            parts.append(f"{self.changed + self.removed:,} line(s) changed or removed")
        if self.added:
            parts.append(f"{self.added:,} added")
        where = f" (first at line {self.first_line})" if self.first_line is not None else ""
        return ", ".join(parts) + where if parts else "unchanged"


def compare_sources(old: bytes, new: bytes) -> SourceChange:
    before: dict[int, tuple[int, int]] = {}
    for id_digest, content, line in ENTRY.iter_unpack(old):
        before[id_digest] = (content, line)
    changed = added = 0
    first_rewrite: int | None = None
    first_added: int | None = None
    for id_digest, content, line in ENTRY.iter_unpack(new):
        old_entry = before.pop(id_digest, None)
        if old_entry is None:
            added += 1
            first_added = line if first_added is None else min(first_added, line)
        elif old_entry[0] != content:
            changed += 1
            first_rewrite = line if first_rewrite is None else min(first_rewrite, line)
    for _content, line in before.values():
        first_rewrite = line if first_rewrite is None else min(first_rewrite, line)
    candidates = [x for x in (first_rewrite, first_added) if x is not None]
    return SourceChange(changed, len(before), added, min(candidates) if candidates else None)
