"""Object-storage URLs: what a URL is, `--storage-option` parsing, the store a URL opens (`Remote`),
URLs and messages shown with their secrets redacted, and what a store raises said in one line.

fsspec (and s3fs for s3://) is imported only inside `open_remote`, when a URL is used: local
paths never load it.
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rbtool.errors import CheckpointError, RbtoolError, UsageError
from rbtool.format import one_line

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(value: str | os.PathLike[str]) -> bool:
    """True for a URL naming object storage (`scheme://...`); file:// URLs and plain paths are local."""
    return isinstance(value, str) and bool(_URL.match(value)) and not value.lower().startswith("file://")


def local_path(value: str | os.PathLike[str]) -> Path:
    """A local path as given; a file:// URL becomes its path."""
    if isinstance(value, str) and value.lower().startswith("file://"):
        from urllib.parse import unquote, urlsplit

        parts = urlsplit(value)
        if parts.netloc not in ("", "localhost"):
            raise UsageError(f"{value}: a file:// URL names this machine (file:///path)")
        return Path(unquote(parts.path))
    return Path(value)


def parse_storage_options(pairs: Sequence[str] | None) -> dict[str, Any]:
    """`key=value` pairs as fsspec storage options: a value that parses as JSON is that value, else a string.

    A dotted key nests (`client_kwargs.region_name=eu-west-1`).
    """
    options: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            shown = "(hidden: it may hold a secret)" if _SECRET_OPTION.search(pair) else repr(pair)
            raise UsageError(f"storage option {shown}: expected key=value")
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        *outer, last = key.strip().split(".")
        place = options
        for part in outer:
            nested = place.setdefault(part, {})
            if not isinstance(nested, dict):
                raise UsageError(f"storage option {pair!r}: {part} is already set to a value")
            place = nested
        place[last] = value
    return options


@dataclass
class Remote:
    """A directory in object storage: the filesystem and the path in it (no trailing slash)."""

    url: str
    fs: Any
    root: str

    def key(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def child(self, name: str) -> Remote:
        return Remote(f"{self.url.rstrip('/')}/{name}", self.fs, self.key(name))


def _workers(jobs: int | None) -> int:
    """How many objects move to or from a store at once: `jobs`, else four per CPU, at most 16."""
    return jobs or min(16, (os.cpu_count() or 1) * 4)


def open_remote(url: str, options: dict[str, Any] | None = None) -> Remote:
    """The fsspec filesystem for `url`, with `options` on top of the environment's configuration."""
    try:
        import fsspec
        from fsspec.core import url_to_fs
    except ImportError:
        raise RbtoolError(f"{url}: URLs need fsspec; install rbtool[s3] (pip install 'rbtool[s3]')") from None
    try:
        cls = fsspec.get_filesystem_class(url.split("://", 1)[0].lower())
    except (ImportError, ValueError) as exc:  # the scheme's fsspec package is missing (s3fs, gcsfs, ...)
        hint = "; install rbtool[s3]" if url.lower().startswith(("s3://", "s3a://")) else ""
        raise RbtoolError(f"{shown_url(url)}: {redact(one_line(str(exc)), options)}{hint}") from None
    _check_options(url, cls, options or {})
    try:
        with store_errors(url, "cannot open", options):
            fs, root = url_to_fs(url, **(options or {}))
    except ImportError as exc:
        raise RbtoolError(f"{shown_url(url)}: {redact(one_line(str(exc)), options)}") from None
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{shown_url(url)}: {redact(one_line(str(exc)), options)}") from None
    return Remote(url.rstrip("/"), fs, str(root).rstrip("/"))


# Options every fsspec filesystem takes (fsspec.spec.AbstractFileSystem and its caching).
_COMMON_OPTIONS = {
    "skip_instance_cache",
    "use_listings_cache",
    "listings_expiry_time",
    "max_paths",
    "asynchronous",
    "loop",
}
_SECRET_OPTION = re.compile(r"secret|token|password|key|credential", re.IGNORECASE)
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")


def _check_options(url: str, cls: type, options: dict[str, Any]) -> None:
    """Refuse a storage option the filesystem of `url` does not take, or a value of the wrong kind
    for an option whose default is a boolean or a number (`anon=maybe`)."""
    import inspect as pyinspect

    known: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = pyinspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            continue
        for p in params:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                known[p.name] = p.default
    for key, value in options.items():
        shown = f"{key}=***" if _SECRET_OPTION.search(key) else f"{key}={json.dumps(value)}"
        if key not in known and key not in _COMMON_OPTIONS:
            close = sorted(k for k in known if not k.startswith("_"))
            raise UsageError(
                f"{url}: unknown storage option {shown} for {cls.__name__} (it takes: {', '.join(close)})"
            )
        default = known.get(key)
        if isinstance(default, bool) and not isinstance(value, bool):
            raise UsageError(f"{url}: storage option {shown} takes true or false")
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if type(default) in (int, float) and value is not None and not number:
            raise UsageError(f"{url}: storage option {shown} takes a number")


def _secrets(options: dict[str, Any] | None) -> list[str]:
    """The values of options (nested too) and environment variables that hold secrets."""
    found: list[str] = []

    def walk(place: dict[str, Any]) -> None:
        for key, value in place.items():
            if isinstance(value, dict):
                walk(value)
            elif _SECRET_OPTION.search(str(key)) and value not in (None, True, False, ""):
                found.append(str(value))

    walk(options or {})
    found += [os.environ[name] for name in _SECRET_ENV if os.environ.get(name)]
    return sorted({s for s in found if len(s) >= 3}, key=len, reverse=True)


def redact(text: str, options: dict[str, Any] | None = None) -> str:
    """`text` with every secret (values of key/secret/token/password options and of the AWS
    credentials' environment variables, a URL's user:password@) replaced by ***."""
    for secret in _secrets(options):
        text = text.replace(secret, "***")
    return re.sub(r"(://)[^/@\s]+@", r"\1***@", text)


def shown_url(url: str) -> str:
    """A URL as it is printed: without the password or key a user:password@ part holds."""
    return re.sub(r"(://)[^/@\s]+@", r"\1***@", url)


_NO_CREDENTIALS = (
    "no credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), "
    "or give the storage options key and secret"
)


def _store_reason(exc: BaseException) -> str:
    """What a store error says, in one line."""
    name = type(exc).__name__
    text = one_line(str(exc)) or name
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return _NO_CREDENTIALS + f" ({text})"
    if name in _CONNECT_ERRORS:
        return f"cannot connect to the endpoint ({text}); check endpoint_url or AWS_ENDPOINT_URL"
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on the local disk (the cache: RBTOOL_CACHE_DIR)"
    if isinstance(exc, OSError) and exc.strerror:
        text = one_line(exc.strerror)
    if isinstance(exc, FileNotFoundError) and "bucket" in text.lower():
        return f"{text} (no such bucket)"
    return text


_CONNECT_ERRORS = ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError")
_STORE_MODULES = ("botocore", "aiobotocore", "s3fs", "fsspec", "aiohttp", "gcsfs", "google", "adlfs", "azure")


@contextmanager
def store_errors(url: str, doing: str, options: dict[str, Any] | None = None) -> Iterator[None]:
    """Turn what object storage raises in the block (OSError, botocore's and the HTTP client's
    errors) into one CheckpointError naming `url`, secrets redacted; anything else passes."""
    try:
        yield
    except RbtoolError:
        raise
    except Exception as exc:
        module = type(exc).__module__.split(".")[0]
        if not isinstance(exc, OSError) and module not in _STORE_MODULES:
            raise
        reason = redact(f"{doing} ({_store_reason(exc)})", options)
        raise CheckpointError(f"{shown_url(url)}: {reason}") from None
