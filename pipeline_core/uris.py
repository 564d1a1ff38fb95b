"""Fully qualified URIs for every path (DESIGN.md principle 3).

A bare path never reaches Spark or the store: on a cluster `fs.defaultFS` would silently
reinterpret it. Local paths are qualified explicitly with `qualify`; places that demand a URI
call `require_uri`. User-supplied parts of a path (dataset version, run id) go through
`safe_component`, so they cannot climb out of a run's or a version's prefix.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

SCHEMES = ("file", "s3", "hdfs")
_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def scheme_of(uri: str) -> str | None:
    """The URI's scheme, or None for a bare path."""
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", uri)
    return m.group(1).lower() if m else None


def require_uri(value: str, what: str = "path") -> str:
    """Return `value` if it is a fully qualified URI of a supported scheme; raise otherwise."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what}: expected a URI such as file:///abs/path or s3://bucket/prefix, got {value!r}")
    scheme = scheme_of(value)
    if scheme is None:
        raise ValueError(
            f"{what}: {value!r} is a bare path; give a fully qualified URI "
            f"(file:///absolute/path, s3://bucket/prefix or hdfs://namenode/path)"
        )
    if scheme == "s3a":
        value, scheme = "s3" + value[3:], "s3"
    if scheme not in SCHEMES:
        raise ValueError(f"{what}: unsupported scheme {scheme!r} in {value!r}; use one of {', '.join(SCHEMES)}")
    if "?" in value or "#" in value:
        # urlsplit would silently drop them (s3://b/run#1 -> s3://b/run): refuse rather than guess
        raise ValueError(
            f"{what}: {value!r} contains '?' or '#'; a store URI has no query or fragment "
            "(rename the path, or percent-encode the character as %3F / %23)"
        )
    parts = urlsplit(value)
    if parts.query or parts.fragment or value.endswith(("?", "#")):
        # urlsplit drops '?…'/'#…' from the path: the object written would not be the one named
        raise ValueError(f"{what}: {value!r} has a query or fragment ('?' or '#'); object-store URIs take neither")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"{what}: file URI {value!r} must be file:///absolute/path (no host)")
    elif not parts.netloc:
        raise ValueError(f"{what}: {value!r} has no bucket/host")
    _reject_traversal(parts.path, what)
    return value


def qualify(path_or_uri: str | Path) -> str:
    """Explicitly turn a local path into an absolute `file://` URI; validate URIs as they are."""
    s = str(path_or_uri)
    if scheme_of(s) is not None:
        return require_uri(s)
    return "file://" + quote(str(Path(s).expanduser().resolve()))


def to_local_path(uri: str) -> Path:
    """The local filesystem path of a `file://` URI."""
    uri = require_uri(uri)
    if scheme_of(uri) != "file":
        raise ValueError(f"{uri!r} is not a local file:// URI")
    return Path(unquote(urlsplit(uri).path))


def is_local(uri: str) -> bool:
    return scheme_of(require_uri(uri)) == "file"


def split_bucket_key(uri: str) -> tuple[str, str]:
    """`s3://bucket/a/b` -> (`bucket`, `a/b`)."""
    uri = require_uri(uri)
    parts = urlsplit(uri)
    if scheme_of(uri) != "s3":
        raise ValueError(f"{uri!r} is not an s3:// URI")
    return parts.netloc, parts.path.lstrip("/")


def join(uri: str, *parts: str) -> str:
    """Append path parts to a URI. Each part is checked: no traversal, no absolute parts."""
    base = require_uri(uri).rstrip("/")
    for p in parts:
        p = str(p).strip("/")
        if not p:
            continue
        _reject_traversal(p, "path part")
        base = f"{base}/{p}"
    return base


def parent(uri: str) -> str:
    base = require_uri(uri).rstrip("/")
    head, _, _ = base.rpartition("/")
    if head.endswith(":/") or head.endswith("//"):
        raise ValueError(f"{uri!r} has no parent")
    return head


def name(uri: str) -> str:
    return require_uri(uri).rstrip("/").rpartition("/")[2]


def to_spark_uri(uri: str) -> str:
    """Spark reads object stores through Hadoop's s3a connector."""
    uri = require_uri(uri)
    return "s3a" + uri[2:] if scheme_of(uri) == "s3" else uri


def safe_component(value: str, what: str) -> str:
    """Validate one user-supplied path component (dataset version, run id, config id)."""
    if not isinstance(value, str) or not _COMPONENT.match(value) or ".." in value:
        raise ValueError(
            f"{what}: {value!r} is not allowed; use 1-128 characters from letters, digits, '.', '_', '-', "
            f"starting with a letter or digit, without '..'"
        )
    return value


def _reject_traversal(path: str, what: str) -> None:
    segments = unquote(path).split("/")
    if any(seg in ("..", ".") for seg in segments) or "\\" in path or "\x00" in path:
        raise ValueError(f"{what}: {path!r} contains '..', '.', a backslash or NUL; refusing a path that can escape its prefix")


def safe_relpath(path: object, what: str) -> str:
    """`path` if it is a plain relative '/'-separated path; ValueError otherwise (the store is data)."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"{what}: {path!r} is not a non-empty string")
    segments = path.split("/")
    if path.startswith("/") or "\\" in path or "\x00" in path or any(s in ("", ".", "..") for s in segments):
        raise ValueError(
            f"{what}: {path!r} is absolute or contains '..', '.', '//', a backslash or NUL; "
            "refusing a path that could escape its directory"
        )
    return path
