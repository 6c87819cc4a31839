"""``kvcompact``: one command, one subcommand per job; each subcommand lives in the module named after it."""

from __future__ import annotations

import sys

_USAGE = """usage: kvcompact COMMAND [ARGS]    (kvcompact --version)

commands:
  serve       vLLM's OpenAI server with compression on (default: the bundled SmolLM2-135M-Instruct)
  prepare     build a model folder and its calibration stats (default: the bundled model; --model NAME|DIR)
  calibrate   capture pre-RoPE query statistics of a model (for policy triattention)
  bench       run a benchmark from bench/ (memory, throughput, overhead, accuracy, accuracy_engine, answers,
              pressure, speculative, reliability)
  doctor      diagnose "KV compression enabled, no memory savings" against a vLLM endpoint
  plan        KV capacity arithmetic for a model config and a memory size
"""


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
    if command == "serve":
        from kvcompact.tools.serve import main as run
    elif command == "prepare":
        from kvcompact.tools.prepare import main as run
    elif command == "calibrate":
        from kvcompact.tools.calibrate import main as run
    elif command == "bench":
        from kvcompact.tools.bench import main as run
    elif command == "doctor":
        from kvcompact.tools.doctor import main as run
    elif command == "plan":
        from kvcompact.tools.capacity import main as run
    else:
        print(f"kvcompact: unknown command {command!r}\n\n{_USAGE}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
