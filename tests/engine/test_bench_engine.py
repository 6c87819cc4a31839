"""The engine-mode benchmarks' plumbing, on the bundled model at --quick size (real engine, subprocess, as a
user runs them). What is checked is what the numbers depend on: cells switched per request really reach the
engine, and the fixed pool really holds only --pool-requests full-length requests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.extended]  # four engine subprocesses: outside scripts/test.sh


def bench(tmp_path: Path, *args: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1")
    proc = subprocess.run([sys.executable, "-m", "kvcompact.tools.cli", "bench", *args, "--quick",
                           "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = next((tmp_path / args[0]).glob("*/result.json"))
    assert (result.parent / "plot.png").stat().st_size > 0
    return json.loads(result.read_text())["result"]


def test_accuracy_engine_mode_switches_cells_per_request(tmp_path):
    r = bench(tmp_path, "accuracy", "--tasks", "passkey", "--policies", "streaming")
    cells = r["tasks"]["passkey"]["cells"]
    assert set(cells) == {"full", "streaming@64", "streaming@128", "streaming+protect_prompt@64",
                          "streaming+protect_prompt@128"}
    # full attention rides as {"kvcompact": "off"} on an engine configured to compress: no round ran for it,
    # while the same prompts at budget 64 were compressed (a per-request switch that did not reach the engine
    # would show rounds for "full", or none for the budget cells)
    assert cells["full"]["rounds_per_request"] == 0
    assert cells["streaming@64"]["rounds_per_request"] >= 1
    # protect_prompt raises the budget over the prompt: nothing is evicted within the short answer
    assert cells["streaming+protect_prompt@64"]["rounds_per_request"] == 0
    for name, c in cells.items():
        assert c["n"] == 2 and 0 <= c["ci95"][0] <= c["accuracy"] <= c["ci95"][1] <= 1, name
        if name != "full":
            assert c["paired"]["only_full"] + c["paired"]["only_cell"] <= c["n"]
    assert cells["streaming+protect_prompt@64"]["agreement"] == 1.0


def test_answers_pool_holds_two_full_requests(tmp_path):
    r = bench(tmp_path, "answers")
    s, cells = r["setup"], r["cells"]
    assert s["pool_requests"] == 2 and set(cells) == {"stock", "admission", "streaming@64"}
    # guaranteed admission in a pool of 2 full-length requests: full attention never runs more than 2 at once,
    # the compressed cell runs more, and neither preempts
    assert cells["admission"]["peak_running"] <= 2
    assert cells["streaming@64"]["peak_running"] > 2
    assert cells["admission"]["preemptions"] == 0 and cells["streaming@64"]["preemptions"] == 0
    # stock vLLM admits by the prompt's blocks alone: in the same pool it runs more than 2 at once, which a
    # stock cell that went through kvcompact's guaranteed admission could not
    assert cells["stock"]["peak_running"] > 2
    # ...and pays for it: the answers outgrow the pool, so stock preempts (drive reads vLLM's per-request count;
    # a counter that never counts would pass the zeros above)
    assert cells["stock"]["preemptions"] > 0
    # the ratios' denominator is the stock cell (one repetition: the median is that repetition's ratio)
    for name, c in cells.items():
        assert c["tokens_per_s_x_stock"]["median"] == pytest.approx(
            c["tokens_per_s"] / cells["stock"]["tokens_per_s"]), name
        assert c["tokens_per_s_x_admission"]["median"] == pytest.approx(
            c["tokens_per_s"] / cells["admission"]["tokens_per_s"]), name


def test_longgen_stock_is_plain_vllm_and_protect_prompt_keeps_the_prompt(tmp_path):
    """longgen --quick on the bundled model: the stock cell runs vLLM without kvcompact (no round; its blocks grow
    with the answer), the protect_prompt cell's last rounds kept the whole prompt. Control: the fixed cell's
    rounds evicted part of the prompt, and held fewer blocks than stock."""
    r = bench(tmp_path, "longgen", "--pools", "2", "--variants", "prompt,fixed", "--no-admission",
              "--divide-length", "32")
    cells = r["pools"]["2"]
    assert set(cells) == {"stock", "streaming+prompt@64", "streaming+fixed@64"}
    stock, kept, fixed = cells["stock"], cells["streaming+prompt@64"], cells["streaming+fixed@64"]
    assert stock["rounds_per_request"] == 0 and stock["last_round_prompt_kept"] is None
    assert kept["rounds_per_request"] >= 1 and kept["last_round_prompt_kept"] == 1.0
    assert fixed["rounds_per_request"] >= 1 and fixed["last_round_prompt_kept"] < 1.0
    assert fixed["peak_blocks_max"] < stock["peak_blocks_max"]
    assert r["setup"]["prefix_caching"] and stock["answers_per_min_x_stock"]["median"] in (1.0, None)
    # one token per running answer per step at most: a cell ran at least as many steps as its answers' mean length
    assert all(c["steps"][0] >= c["mean_tokens"] > 0 for c in cells.values())


def test_idle_switches_kvcompact_off_in_the_same_engine(tmp_path):
    """idle --quick: both modes run the same steps and tokens with no round, and the switch is real: kvcompact
    tracked every answer of an "on" run to its end and none of an "off" run (a switch that left kvcompact on, or
    off, fails one side)."""
    r = bench(tmp_path, "idle")
    answers = r["setup"]["answers"]
    assert r["same_steps"] and r["same_tokens"]
    assert [x["tracked"] for x in r["runs"]["on"]] == [answers] * r["setup"]["reps"]
    assert [x["tracked"] for x in r["runs"]["off"]] == [0] * r["setup"]["reps"]
    assert r["step_s_on_x_off"]["median"] is not None
