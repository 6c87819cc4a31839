"""What ``kvcompact prepare`` fetches or writes into the cache, made safe to trust: every fetched file is checked
against a pinned sha256 (a cached copy too: a file of the right size may still be corrupt), and every output is
written under a unique temporary name in its own folder and renamed into place, so two ``prepare`` running at once
never write into the same file and a reader never sees half of one."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class DownloadError(RuntimeError):
    """A fetched or cached file that does not hash to its pinned sha256."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def verified(path: Path, sha256: str) -> bool:
    """Whether ``path`` exists and hashes to ``sha256``."""
    return path.is_file() and sha256_of(path) == sha256


def check(path: Path, sha256: str, what: str) -> Path:
    """``path``, or a :class:`DownloadError` naming both hashes when it differs from the pinned one."""
    actual = sha256_of(path)
    if actual != sha256:
        raise DownloadError(f"{what} ({path}) has sha256 {actual}, expected {sha256}: refused")
    return path


@contextmanager
def atomic_output(out: Path, directory: bool = False) -> Iterator[Path]:
    """A unique temporary file (or folder) next to ``out``, renamed to ``out`` when the block ends without an
    exception and removed otherwise. A folder replaces an existing ``out`` only if none appeared meanwhile (a
    concurrent run that finished first wins; its result is kept)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
        os.close(fd)
        tmp = Path(name)
        tmp.chmod(0o644)  # mkstemp's 0600 would make a shared cache unreadable to others
    try:
        yield tmp
        if directory:
            try:
                tmp.rename(out)
            except OSError:
                if not out.exists():
                    raise
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink()


def fetch(url: str, sha256: str, out: Path, timeout: float = 180) -> Path:
    """``out``, downloaded from ``url`` unless a copy with the pinned ``sha256`` is there already; a download
    that hashes otherwise is refused and leaves nothing."""
    if verified(out, sha256):
        return out
    with atomic_output(out) as tmp:
        with urllib.request.urlopen(url, timeout=timeout) as resp, tmp.open("wb") as f:
            while chunk := resp.read(1 << 20):
                f.write(chunk)
        check(tmp, sha256, f"the download of {url}")
    return out


__all__ = ["DownloadError", "atomic_output", "check", "fetch", "sha256_of", "verified"]
