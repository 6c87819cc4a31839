"""``kvcompact bench NAME [--quick] [--out DIR] [benchmark options]``: run one benchmark of ``bench/``.

A benchmark is ``bench/<name>.py`` (:func:`bench_dir`), which defines ``add_arguments(parser)`` (optional) and
``run(ctx) -> dict``. This module loads the file by path, gives it a :class:`Context` (options, output folder,
progress bars, an in-process vLLM engine factory, small statistics helpers) and writes what it returns, with the
machine and the exact command, into a fresh folder ``<out>/<name>/<UTC timestamp>/`` (:func:`fresh_dir`; ``<out>``
defaults to ``results/`` of the checkout, which git ignores, else of the working folder). Benchmarks are not tests:
each runs the configurations it compares side by side in one process and reports medians and ratios (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvcompact.tools.cli import EXIT_USAGE, UsageError
from kvcompact.tools.machine import cpu_isa, serving_dtype

BENCHMARKS = ("memory", "throughput", "overhead", "accuracy", "answers", "pressure", "speculative", "longgen",
              "gpu_round", "recall", "idle", "reliability")
ALIASES = {"compaction": "overhead", "gpu-round": "gpu_round"}  # the compaction benchmark is part of overhead
# A round every divide_length tokens, the prompt evictable like any token: what a cell named policy@budget measures
# (and kvcompact's default before budget mode pressure). Benches merge it into their configurations so a cell keeps
# meaning what it measured whatever the defaults; the tests written for fixed rounds use it too (tests/support).
FIXED_ROUNDS = {"budget_mode": "fixed", "protect_prompt": False}

_USAGE = """usage: kvcompact bench NAME [--quick] [--out DIR] [options]

benchmarks (bench/NAME.py):
  memory      "evict 90%, free nothing": blocks held and kv usage vs generated tokens, reclaim efficiency
  throughput  concurrent long generations in a small pool: tokens/s, preemptions; decode step time
  overhead    per-round scoring / selection / move ms and bytes, repack vs holefill, vs decode step time
              (alias: compaction)
  accuracy    reasoning, passkey and recall accuracy through the engine vs full attention (--tasks); perplexity
              and the older tests through the transformers reference (--tests; --gate [--tolerance X] exits
              non-zero on a loss beyond the tolerance)
  answers     correct answers per minute at a fixed pool: full attention vs each (policy, budget)
  pressure    budget mode pressure vs full attention and a fixed budget, load swept at a fixed pool: accuracy
              and correct answers per minute per load
  speculative n-gram speculative decoding x {full attention, compressed} at a fixed pool: tokens/s, correct
              answers per minute, vLLM's acceptance rate with and without compression
  longgen     long answers (several problems, results restated at the end) against stock vLLM in a small and
              a large pool: accuracy, correct answers per minute, peak blocks per request, preemptions
  gpu_round   a round's hot path on a CUDA paged cache at Qwen3-8B shapes, no engine (alias gpu-round): checks
              against the CPU path, then per-phase ms, round / 128 decode steps, move GB/s / copy GB/s
  recall      the recall tier's work in one forward (serve's default, recall inside the forward) at the 1.5B's
              shapes, no engine: checks the batched decision against each request's own, then ms per forward
              and operator calls per layer decision, against the decode rows with a store
  idle        what kvcompact costs a step where no round runs: serve's configuration switched on and off
              between alternating runs in one engine (median step time on / off, the same tokens)
  reliability a `kvcompact serve` soak (mixed load, aborts, disconnects; memory, errors, leaked blocks), an
              abort storm and SIGTERM with requests in flight

`kvcompact bench NAME --help` lists a benchmark's own options.
"""


def checkout_root() -> Path | None:
    """The checkout an editable install runs from (``src/kvcompact/tools/bench.py`` -> its root), or None."""
    here = Path(__file__).resolve().parents[3]
    return here if (here / "bench").is_dir() and (here / "src" / "kvcompact").is_dir() else None


def bench_dir() -> Path:
    """The checkout's ``bench/``, else the copy the wheel installs (``kvcompact/bench``): a checkout's own folder
    wins, so an editable install runs the files being edited."""
    root = checkout_root()
    return root / "bench" if root is not None else Path(__file__).resolve().parents[1] / "bench"


def load_benchmark(name: str) -> Any:
    path = bench_dir() / f"{name}.py"
    if not path.exists():
        raise SystemExit(f"kvcompact bench: no benchmark {name!r} ({path} does not exist)")
    spec = importlib.util.spec_from_file_location(f"kvcompact_bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def utc_stamp() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")


def fresh_dir(base: Path, name: str) -> Path:
    """``base/name/<UTC timestamp>``, with a numeric suffix rather than reusing an existing folder."""
    stamp = utc_stamp()
    parent = base / name
    parent.mkdir(parents=True, exist_ok=True)
    for i in range(1000):
        candidate = parent / (stamp if i == 0 else f"{stamp}-{i}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise SystemExit(f"kvcompact bench: could not make a fresh folder under {parent}")


def machine_info() -> dict[str, Any]:
    dtype, why = serving_dtype()
    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version(), "cpu_isa": cpu_isa(),
                            "serving_dtype": dtype, "serving_dtype_why": why}
    try:
        info["load_avg"] = list(os.getloadavg())
    except OSError:
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    for mod in ("torch", "transformers", "vllm"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - informative only
            pass
    root = checkout_root()
    try:
        if root is not None:
            info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                                                capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    return info


# ---------------------------------------------------------------------------------------------- statistics
def median(xs: Iterable[float]) -> float | None:
    xs = [float(x) for x in xs]
    return statistics.median(xs) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b in (None, 0) else float(a) / float(b)


def median_range(xs: Iterable[float | None]) -> dict[str, float | None]:
    """Median and range of per-repetition values (None dropped): how a ratio between cells that ran in the same
    repetitions is reported, so one noisy repetition shows as a wide range instead of moving a single number."""
    vals = sorted(float(x) for x in xs if x is not None)
    if not vals:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(vals), "min": vals[0], "max": vals[-1]}


def paired_ratio(values: Iterable[float | None], base: Iterable[float | None]) -> dict[str, float | None]:
    """``median_range`` of ``value / base`` per repetition (the i-th value against the i-th base, which ran in the
    same repetition): the ``x_stock`` ratios of the fixed-pool benchmarks."""
    return median_range(ratio(a, b) for a, b in zip(values, base, strict=True))


def times(r: float | dict[str, float | None] | None) -> str:
    """A ratio (or a ``median_range``'s median) for a printed line: ``x1.23``, or ``x-`` where there is none
    (a zero denominator: no correct answer in the base cell)."""
    value = r.get("median") if isinstance(r, dict) else r
    return "x-" if value is None else f"x{value:.2f}"


def summary(xs: Iterable[float]) -> dict[str, Any]:
    xs = sorted(float(x) for x in xs)
    if not xs:
        return {"n": 0}
    q = lambda p: xs[min(len(xs) - 1, int(p * (len(xs) - 1) + 0.5))]  # noqa: E731
    return {"n": len(xs), "median": statistics.median(xs), "p10": q(0.1), "p90": q(0.9), "min": xs[0],
            "max": xs[-1], "mean": statistics.fmean(xs)}


# ---------------------------------------------------------------------------------------------- context
class Context:
    """What a benchmark gets: its options, its output folder (results, plots, checkpoints, log lines), the model
    and policy it runs, and an engine factory in the dtype that scales on this CPU. Stepping an engine is
    :mod:`kvcompact.tools.local_engine`'s (``drive``, ``warm_up``, ``greedy``), shared with the tests."""

    def __init__(self, name: str, args: argparse.Namespace, out_dir: Path, command: str) -> None:
        self.name = name
        self.args = args
        self.quick = bool(args.quick)
        self.out_dir = out_dir
        self.command = command
        self.exit_code = 0
        self.notes: list[str] = []
        self.engine_dtype = serving_dtype()[0]  # what ctx.engine uses unless a benchmark passes dtype

    def log(self, *parts: Any) -> None:
        from tqdm import tqdm

        tqdm.write(" ".join(str(p) for p in parts), file=sys.stderr)

    def progress(self, iterable: Iterable | None = None, *, total: int | None = None, desc: str = "") -> Any:
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False)

    def path(self, filename: str) -> Path:
        return self.out_dir / filename

    def checkpoint(self, partial: Any) -> None:
        """Write what a long benchmark has so far to ``partial.json`` (a killed run keeps its finished parts)."""
        self.path("partial.json").write_text(json.dumps(partial, indent=1, default=_jsonable) + "\n")

    def savefig(self, fig: Any, filename: str = "plot.png") -> Path:
        path = self.path(filename)
        fig.savefig(path, dpi=90, bbox_inches="tight")
        import matplotlib.pyplot as plt

        plt.close(fig)
        return path

    # -- policy ---------------------------------------------------------------------------------------
    def scoring_policy(self, requested: str | None = None) -> tuple[str, str | None, str]:
        """(policy, stats_path, why): TriAttention when the bundled model's statistics are ready (or
        ``--calibrate`` makes them), else StreamingLLM; the reason goes into the results."""
        from kvcompact.tools.model import default_stats_path

        if requested and requested != "triattention":
            return requested, None, f"policy {requested} requested"
        path = default_stats_path()
        if not path.exists() and getattr(self.args, "calibrate", False):
            from kvcompact.tools.serve import ensure_default_stats

            ensure_default_stats()
        if path.exists():
            return "triattention", str(path), f"triattention with the bundled model's statistics ({path})"
        if requested == "triattention":
            raise UsageError(f"policy triattention needs {path}: run `kvcompact prepare`")
        return "streaming", None, (f"streaming: TriAttention statistics not ready ({path} missing; "
                                   "`kvcompact prepare` or --calibrate makes them)")

    def model_and_stats(self, model: str | None, stats: str | None) -> tuple[str, str | None]:
        """(model folder, TriAttention statistics or None) for a benchmark's ``--model`` / ``--stats``: a folder,
        or a known model name (prepared on first use), with the statistics ``kvcompact prepare`` made unless
        ``stats`` is given; no model: the bundled one and its statistics."""
        from kvcompact.tools.model import KNOWN_MODELS, ensure_default_model, prepared_stats

        if model is None:
            folder = ensure_default_model()
        elif model.lower() in KNOWN_MODELS and not Path(model).is_dir():
            from kvcompact.tools.prepare import prepare_known

            folder = prepare_known(model)[0]
        else:
            folder = Path(model).expanduser().resolve()
            if not folder.is_dir():
                raise UsageError(f"--model {model}: no such folder, and not a known model "
                                 f"({', '.join(KNOWN_MODELS)})")
        found = stats or prepared_stats(folder)
        if found is None and model is None:
            found = self.scoring_policy("triattention")[1]
        return str(folder), None if found is None else str(found)

    # -- engine ---------------------------------------------------------------------------------------
    @contextmanager
    def engine(self, kvcompact: dict[str, Any] | None, *, dtype: str | None = None, block_size: int = 32,
               num_blocks: int = 64, max_model_len: int = 4096, max_num_seqs: int = 8,
               **kwargs: Any) -> Iterator[Any]:
        """An in-process ``vllm.LLM`` on the bundled model (the scheduler and worker are reachable), in the
        dtype that scales on this CPU unless given (recorded in result.json's machine)."""
        from kvcompact.tools.local_engine import local_engine

        with local_engine(kvcompact, dtype=dtype or self.engine_dtype, block_size=block_size,
                          num_blocks=num_blocks, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          **kwargs) as llm:
            yield llm


def _parser(name: str, module: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"kvcompact bench {name}",
                                     description=(module.__doc__ or "").strip().splitlines()[0]
                                     if module.__doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a small version that finishes in a few minutes")
    parser.add_argument("--out", default=None, help="results folder (default: results/ of the checkout, else "
                        "./results); "
                        "the run writes into OUT/NAME/<UTC timestamp>/")
    if hasattr(module, "add_arguments"):
        module.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0
    name = ALIASES.get(argv[0], argv[0])
    if name not in BENCHMARKS:
        print(f"kvcompact bench: unknown benchmark {argv[0]!r}\n\n{_USAGE}", file=sys.stderr)
        return EXIT_USAGE
    # In-process engine (scheduler and worker reachable), loopback only, offline model, quiet logs.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    module = load_benchmark(name)
    args = _parser(name, module).parse_args(argv[1:])
    base = Path(args.out) if args.out else (checkout_root() or Path.cwd()) / "results"
    out_dir = fresh_dir(base, name)
    command = "kvcompact bench " + " ".join(shlex.quote(a) for a in argv)
    (out_dir / "command.txt").write_text(command + "\n")
    ctx = Context(name, args, out_dir, command)
    print(f"kvcompact bench {name}: writing to {out_dir}", file=sys.stderr, flush=True)
    started = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    machine = machine_info()
    t0 = time.perf_counter()
    result = module.run(ctx)
    doc = {"benchmark": name, "command": command, "quick": ctx.quick, "started_utc": started,
           "wall_s": round(time.perf_counter() - t0, 1), "machine": machine,
           "load_avg_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
           "notes": ctx.notes, "result": result, "exit_code": ctx.exit_code}
    (out_dir / "result.json").write_text(json.dumps(doc, indent=2, default=_jsonable) + "\n")
    print(f"kvcompact bench {name}: done in {doc['wall_s']} s -> {out_dir}", file=sys.stderr)
    headline = result.get("headline") if isinstance(result, dict) else None
    if headline:
        print(json.dumps(headline, indent=2, default=_jsonable))
    return ctx.exit_code


def _jsonable(x: Any) -> Any:
    try:
        import numpy as np
        import torch

        if isinstance(x, torch.Tensor):
            return x.tolist()
        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, np.ndarray):
            return x.tolist()
    except ImportError:
        pass
    if isinstance(x, Path):
        return str(x)
    return repr(x)


__all__ = ["main", "Context", "median", "ratio", "median_range", "paired_ratio", "times", "summary", "BENCHMARKS"]
