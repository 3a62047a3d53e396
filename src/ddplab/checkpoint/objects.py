"""Object storage through fsspec: `s3://bucket/prefix` (the `ddplab[s3]` extra) or any URL fsspec
understands, with a bounded wait for every request and one line for each way it fails.

What this module knows is objects, not checkpoints: put a file, read one back whole, list a
prefix, delete. The checkpoint's commit rule on top of it is in store.py and mirror.py.
Credentials and the endpoint come from the environment the storage library reads (`AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL` for an S3-compatible server, an instance's role), never
from ddplab's settings, so a config file can be shared without secrets."""

import os
import re
import secrets
from typing import Any

from ..errors import DdplabError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# a missing package for a scheme fsspec knows: the extra that installs it
_EXTRAS = {"s3": "pip install 'ddplab[s3]'", "s3a": "pip install 'ddplab[s3]'"}


def is_url(path: str | os.PathLike) -> bool:
    """`scheme://...`: a location in object storage (or anything else fsspec reaches), not a local path."""
    return bool(_SCHEME.match(str(path)))


# what a URL with one slash too few looks like (s3:/bucket, s3:bucket): a scheme of two letters or more,
# so that nothing a local path holds is taken for one
_HALF_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/?(?!/)")
# S3's rules for a bucket's name: 3 to 63 lower-case letters, digits, dots and hyphens, a letter or a
# digit at each end, no two dots together, not an IP address
_BUCKET = re.compile(r"(?!\d+\.\d+\.\d+\.\d+$)(?!.*\.\.)[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def check_location(key: str, value: str, local_only: bool = False) -> None:
    """A run folder's location as the user typed it (`key` names the setting): a URL written the way
    its storage reads it, or a local path that is not a misspelt URL; `local_only`: a local path.
    Refused in one line before any worker starts: a URL with one slash would be a local folder
    named 's3:', an upper-case scheme or an invalid bucket name a failure at the first request."""
    text = str(value)
    found = _SCHEME.match(text)
    if found is None:
        if half := _HALF_URL.match(text):
            raise DdplabError(
                f"{key}={text} is a local folder named '{half.group(1)}:' (a URL has two slashes after its scheme)",
                f"write {key}={half.group(1)}://{text[half.end() :]}, or a local path without the colon",
            )
        return
    scheme = found.group(1)
    if local_only:
        raise DdplabError(
            f"{key}={text}: the run's local copy must be a folder on this machine (run.dir is the bucket)",
            f"give {key} a local path (default runs), and the bucket as run.dir",
        )
    if scheme.lower() == "file":
        raise DdplabError(
            f"{key}={text} is a folder on this machine written as a URL",
            f"write it as a path: {key}={text[len(found.group(0)) :] or '/'}",
        )
    if scheme != scheme.lower():
        raise DdplabError(
            f"{key}={text}: the scheme {scheme}:// is written in capitals, which the storage libraries do not read",
            f"write {key}={scheme.lower()}://{text[len(found.group(0)) :]}",
        )
    if scheme in ("s3", "s3a"):
        bucket = text[len(found.group(0)) :].split("/", 1)[0]
        if not _BUCKET.fullmatch(bucket):
            raise DdplabError(
                f"{key}={text}: '{bucket}' is not a valid S3 bucket name (3 to 63 lower-case letters, digits, dots "
                "and hyphens, starting and ending with a letter or digit)",
                f"name the bucket the run is to be written to, e.g. {key}={scheme}://my-bucket/runs",
            )


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


# a transfer may take run.storage_timeout_s per started 100 MB
PER_TIMEOUT = 100 * 2**20
# how long one request may wait, in this process (run.storage_timeout_s; the trainer sets it)
TIMEOUT_S = [60.0]
_STORES: dict[tuple[str, float], "ObjectStore"] = {}


def store_for(url: str) -> "ObjectStore":
    """One ObjectStore per prefix and timeout in a process: opening one costs a client."""
    key = (url.rstrip("/"), TIMEOUT_S[0])
    if key not in _STORES:
        _STORES[key] = ObjectStore(*key)
    return _STORES[key]


class StorageError(DdplabError):
    """A request to the object store failed: no answer in time, access denied, no such bucket."""

    def __init__(self, cause: str, fix: str | None = None, reason: str = ""):
        super().__init__(cause, fix)
        # the failure alone, in a few words (describe())
        self.reason = reason


class ObjectStore:
    """One URL prefix in object storage. Paths given to the methods are relative to it."""

    def __init__(self, url: str, timeout_s: float = 60.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.fs, self.root = _open(self.url, timeout_s)

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def put_file(self, local: str, *parts: str) -> None:
        size = os.path.getsize(local)
        self._do("write", parts, lambda p, t: self.fs.put_file(local, p, timeout=t), size)

    def put_bytes(self, data: bytes, *parts: str) -> None:
        self._do("write", parts, lambda p, t: self.fs.pipe_file(p, data, timeout=t), len(data))

    def create_bytes(self, data: bytes, *parts: str) -> bool:
        """Write an object only where none exists, as the store decides (If-None-Match: two writers
        of one name cannot both succeed); False when one already did."""

        def create(path, t):
            try:
                self.fs.pipe_file(path, data, mode="create", timeout=t)
            except FileExistsError:
                return False
            return True

        return self._do("write", parts, create, len(data))

    def read_bytes(self, *parts: str) -> bytes:
        return self._do("read", parts, lambda p, t: self.fs.cat_file(p, timeout=t), self._size(parts))

    def exists(self, *parts: str) -> bool:
        return self._do("read", parts, lambda p, t: self.fs.exists(p, timeout=t))

    def find(self, *parts: str) -> list[str]:
        """Every object under the prefix, as paths relative to this store (one listing request on S3;
        never answered from a cache: another machine may have written since)."""
        self.fs.invalidate_cache()
        found = self._do("list", parts, lambda p, t: self.fs.find(p, timeout=t))
        return [f[len(self.root) + 1 :] for f in found]

    def remove(self, *parts: str) -> None:
        def rm(path, t):
            # one object, or everything under a prefix
            found = self.fs.find(path, timeout=t) + ([path] if self.fs.isfile(path, timeout=t) else [])
            if found:
                self.fs.rm(sorted(set(found)), timeout=t)

        self._do("delete", parts, rm)

    def check_writable(self) -> None:
        """Write a small object and delete it: the bucket exists, answers, and these credentials may
        write. Done before any training, so a run never learns it at its first checkpoint."""
        probe = f".ddplab-write-check-{secrets.token_hex(4)}"
        try:
            self.put_bytes(b"ddplab checks that it may write here\n", probe)
            self.remove(probe)
        except StorageError as e:
            raise StorageError(f"run.dir={self.url} cannot be written ({e.reason})", e.fix, e.reason) from None

    def _size(self, parts: tuple[str, ...]) -> int:
        """An object's size, for the time its read may take (0 when it cannot be known)."""
        try:
            return int(self.fs.size(self.path(*parts), timeout=self.timeout_s) or 0)
        except Exception:
            return 0

    def _do(self, what: str, parts: tuple[str, ...], call, size: int = 0) -> Any:
        """`call(path, deadline)`: every request is bounded by a deadline of its own (fsspec's), not
        only by the storage library's socket timeouts, which do not cover every wait (botocore asks
        for `Expect: 100-continue` on each upload, and that wait has no timeout of its own). A large
        object gets storage_timeout_s per started 100 MB."""
        path = self.path(*parts)
        try:
            return call(path, self.timeout_s * (1 + size // PER_TIMEOUT))
        except Exception as e:
            why = describe(e, self.timeout_s)
            raise StorageError(f"could not {what} {self.url}/{'/'.join(parts)} ({why})", _fix(e), why) from None


def _open(url: str, timeout_s: float):
    """fsspec's filesystem for `url`; an unknown scheme or a missing package is one line."""
    import fsspec

    scheme = _SCHEME.match(url).group(1).lower()
    try:
        # ddplab's own instance: the timeouts below are not shared with other users of fsspec
        fs, root = fsspec.url_to_fs(url, skip_instance_cache=True, **_options(scheme, timeout_s))
    except ValueError as e:
        if "Protocol not known" not in str(e):
            raise
        raise DdplabError(
            f"{url}: no storage library here knows the scheme {scheme}://",
            "use s3://BUCKET/PREFIX (pip install 'ddplab[s3]') or a local path",
        ) from None
    except ImportError as e:
        install = _EXTRAS.get(scheme, f"install the fsspec package for {scheme}:// ({e})")
        raise DdplabError(f"{url} needs a package that is not installed", install) from None
    if hasattr(fs, "retries"):
        # s3fs's own retries, on top of botocore's: one pass
        fs.retries = 1
    return fs, root.rstrip("/")


def _options(scheme: str, timeout_s: float) -> dict:
    """Each request waits at most timeout_s and is tried twice (botocore's retries; s3fs's own on top
    are turned off in _open): without this a store that stops answering holds a save for minutes."""
    if scheme not in ("s3", "s3a"):
        return {}
    return {
        "config_kwargs": {
            "connect_timeout": timeout_s,
            "read_timeout": timeout_s,
            "retries": {"max_attempts": 2, "mode": "standard"},
        }
    }


def describe(e: BaseException, timeout_s: float) -> str:
    """The cause of a failed request in a few words."""
    return _cause(e, timeout_s)[0]


def _fix(e: BaseException) -> str:
    return _cause(e, 0)[1]


def _cause(e: BaseException, timeout_s: float) -> tuple[str, str]:
    """(the cause of a failed request, in a few words; what to do about it): each cause its own fix,
    so that missing credentials are not answered with advice about the endpoint or the timeout."""
    name = type(e).__name__
    text = str(e).splitlines()[0][:160] if str(e) else name
    if "Timeout" in name or "timed out" in text.lower():
        return (
            f"no answer within {timeout_s:g} s (run.storage_timeout_s)",
            "check AWS_ENDPOINT_URL and the network, or raise run.storage_timeout_s",
        )
    if "EndpointConnectionError" in name or "ConnectionRefused" in name or "Could not connect" in text:
        return f"cannot connect: {text}", "check AWS_ENDPOINT_URL (the store's address) and the network"
    if "NoCredentials" in name or "Unable to locate credentials" in text:
        return (
            "no credentials were found",
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or run where an instance role "
            "gives them",
        )
    if isinstance(e, PermissionError):
        return (
            f"access denied: {text}",
            "give these credentials (AWS_ACCESS_KEY_ID, an instance role) write access to the bucket",
        )
    # the store's own words for it (S3's NoSuchBucket), not a path that happens to hold "bucket"
    if isinstance(e, FileNotFoundError) and ("bucket does not exist" in text.lower() or "NoSuchBucket" in text):
        return "the bucket does not exist", "create the bucket, or check run.dir's bucket name and AWS_ENDPOINT_URL"
    if isinstance(e, FileNotFoundError):
        return (
            f"no such object (FileNotFoundError: {text})",
            "check the path: `ddplab checkpoints RUN` lists the checkpoints a run in a bucket holds",
        )
    return f"{name}: {text}", "check run.dir, the credentials and AWS_ENDPOINT_URL"
