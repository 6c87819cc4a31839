"""How far one compaction round travels through the code: the kvcompact files it passes and how often control
changes file, measured with a profiler on the real engine (the bundled model, one request, one round).

    .venv/bin/python scripts/round_trace.py [--show]

Follows every call and return in kvcompact's and vLLM's own files during the engine step that runs a round
(scheduler and worker side in one process); vLLM's files count as one place, anything else (torch, the standard
library) is not followed. A *hop* is control moving from one file to another, either way; a *seam* is a pair of
files control moves between at least once (a loop over layers adds hops, not seams). ``--show`` prints the
sequence of files. Uses only vLLM's public ``LLM`` and the plugin's configuration, so it measures any version of
kvcompact.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections import Counter
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")


def place(filename: str) -> str | None:
    """kvcompact's files by their path inside the package, vLLM's as one place, None for everything else."""
    norm = filename.replace(os.sep, "/")
    if "/kvcompact/" in norm:
        return norm.rsplit("/kvcompact/", 1)[1]
    if "/vllm/" in norm:
        return "vllm"
    return None


def trace_step(step: Any) -> tuple[Any, list[str]]:
    """Run ``step()`` under a profiler; the sequence of places control was in (consecutive repeats merged)."""
    seq: list[str] = []

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event == "call":
            where = place(frame.f_code.co_filename)
        elif event == "return" and frame.f_back is not None:
            where = place(frame.f_back.f_code.co_filename)
        else:
            return
        if where is not None and (not seq or seq[-1] != where):
            seq.append(where)

    sys.setprofile(profile)
    try:
        out = step()
    finally:
        sys.setprofile(None)
    return out, seq


def default_model() -> str:
    for name in ("kvcompact.tools.model", "kvcompact.model"):
        try:
            return str(importlib.import_module(name).ensure_default_model())
        except ImportError:
            continue
    raise SystemExit("kvcompact is not installed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--show", action="store_true", help="print the sequence of files")
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    config = {"policy": "knorm", "budget": 64, "divide_length": 32, "window": 16, "budget_mode": "fixed",
              "protect_prompt": False}
    llm = LLM(model=default_model(), dtype="float32", max_model_len=512, enforce_eager=True, block_size=32,
              num_gpu_blocks_override=64, kv_cache_memory_bytes=1 << 26, enable_prefix_caching=False, seed=0,
              additional_config={"kvcompact": config})
    engine = llm.llm_engine
    engine.add_request("r0", {"prompt_token_ids": list(range(100, 160))},
                       SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        _, seq = trace_step(engine.step)
        if "selection.py" in seq:  # the step whose worker ran the round (selection runs in rounds only)
            files = [p for p in seq if p != "vllm"]
            hops = len(seq) - 1
            kvc_hops = sum(1 for a, b in zip(seq, seq[1:]) if a != "vllm" and b != "vllm")
            seams = {frozenset(pair) for pair in zip(seq, seq[1:])}
            print(f"one round: {len(set(files))} kvcompact files, {hops} hops ({kvc_hops} between kvcompact files, "
                  f"{hops - kvc_hops} to or from vLLM), {len(seams)} seams")
            print("files:", ", ".join(f"{f} x{n}" for f, n in Counter(files).most_common()))
            if args.show:
                print(" -> ".join(seq))
            return
    raise SystemExit("no round ran")


if __name__ == "__main__":
    main()
