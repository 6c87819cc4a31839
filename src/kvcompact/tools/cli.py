"""``kvcompact``: one command, one subcommand per job; each subcommand lives in the module named after it."""

from __future__ import annotations

import importlib
import sys

_USAGE = """usage: kvcompact COMMAND [ARGS]    (kvcompact --version)

commands:
  serve       vLLM's OpenAI server with compression on (default: the bundled SmolLM2-135M-Instruct)
  prepare     build a model folder and its calibration stats (default: the bundled model; --model NAME|DIR)
  calibrate   capture pre-RoPE query statistics of a model (for policy triattention)
  bench       run a benchmark from bench/ (memory, throughput, overhead, accuracy, accuracy_engine, answers,
              pressure, speculative, longgen, gpu_round, reliability)
  doctor      diagnose "KV compression enabled, no memory savings" against a vLLM endpoint
  capacity    KV capacity arithmetic for a model config and a memory size
"""


EXIT_USAGE = 2  # a bad argument or value the user typed, as argparse exits; runtime failures exit 1


class UsageError(ValueError):
    """A bad argument or value the user typed (an unknown model or variant, a folder that is not there): raised
    anywhere under a subcommand, :func:`main` prints ``kvcompact COMMAND: message`` on stderr and exits
    :data:`EXIT_USAGE`. ``command`` names a deeper one (``"bench longgen"``). Not for ``kvcompact doctor``, whose
    exit codes are verdicts (2: no compression active) and whose usage errors exit 1."""

    def __init__(self, message: str, *, command: str | None = None) -> None:
        super().__init__(message)
        self.command = command


_MODULES = {"serve": "serve", "prepare": "prepare", "calibrate": "calibrate", "bench": "bench", "doctor": "doctor",
            "capacity": "capacity"}
# What each optional import is installed with (pyproject.toml's extras): a tool run without it says so.
_EXTRAS = {"torch": "kvcompact[tools]", "gguf": "kvcompact[tools]", "matplotlib": "kvcompact[bench]",
           "reasoning_gym": "kvcompact[bench]", "vllm": "kvcompact[gpu] (on a CPU host: kvcompact[cpu])"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0
    if argv[0] == "--version":
        from importlib.metadata import version

        print("kvcompact", version("kvcompact"))  # pyproject.toml is the one place the version is written
        return 0
    command, rest = argv[0], argv[1:]
    if command not in _MODULES:
        print(f"kvcompact: unknown command {command!r}\n\n{_USAGE}", file=sys.stderr)
        return EXIT_USAGE
    try:
        run = importlib.import_module(f"kvcompact.tools.{_MODULES[command]}").main
        return run(rest)
    except UsageError as e:
        print(f"kvcompact {e.command or command}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ModuleNotFoundError as e:
        missing = (e.name or "").partition(".")[0]
        if missing not in _EXTRAS:
            raise
        print(f"kvcompact {command}: needs {missing}, which is not installed: pip install '{_EXTRAS[missing]}'",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
