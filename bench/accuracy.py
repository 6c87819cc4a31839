"""Quality against full attention: generation tasks through the engine, perplexity through the reference path.

``--tasks`` (the default): reasoning, passkey and recall through an in-process vLLM engine, every cell switched
per request (``bench/accuracy_engine.py``). ``--tests``: the transformers reference path below (fp32, eager
attention), for teacher-forced perplexity (``ppl``, ``repeat``) and the older one-request-at-a-time tests.

``kvcompact.reference`` applies the same policies, selection and planner as the plugin (the engine tests prove the two
produce identical greedy tokens), so quality measured here is the plugin's quality without starting an engine.
Compression runs during decoding exactly as in the server: the first ``prefix`` tokens are the prompt, the rest
are fed as decode steps with a round whenever the cache reaches ``budget + 128`` tokens.

Tests (each per policy and budget, against full attention on the same tokens):
- ``ppl``:     teacher-forced perplexity of the Britannica excerpt (corpus.eval_text) over the second half of the
               sequence, where every budget has evicted.
- ``repeat``:  a passage, filler text, the same passage again: perplexity of the second copy (low only if the first
               copy survived eviction).
- ``passkey``: a 5-digit pass key hidden at several distances before the question; retrieved if greedy decoding
               reproduces every digit (the prompt is prefilled, then rounds compress it to the budget before
               each further token, as in the server).
- ``greedy``:  greedy generation from a Britannica prompt: first divergence from full attention and share of
               identical tokens.
- ``gsm``:     reasoning-gym ``gsm_symbolic`` problems with a few-shot chain-of-thought prompt (the prompt alone
               exceeds the budget, so rounds evict inside the examples and during the reasoning): answer-change
               rate vs full attention and accuracy of each.

``--gate [--tolerance X]``: exit non-zero when a gated policy and budget raises the ``ppl`` slice's perplexity
by more than X (relative, default 0.10) over full attention. The gate runs only ``ppl`` unless ``--tests`` says
otherwise, so a deployment can run it as a check.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

from kvcompact.tools.cli import UsageError

TESTS = ("ppl", "repeat", "passkey", "greedy", "gsm")


def _engine_mode() -> Any:
    from kvcompact.tools.bench import load_benchmark

    return load_benchmark("accuracy_engine")


def add_arguments(p: Any) -> None:
    _engine_mode().add_arguments(p)
    p.add_argument("--policies", default=None,
                   help="comma list (engine mode default triattention,streaming,knorm; reference path default "
                        "triattention,streaming,knorm,random,snapkv; quick triattention,streaming)")
    p.add_argument("--budgets", default=None,
                   help="comma list (engine mode default 64,128,256,512; reference path 256,512,1024; quick 64,128)")
    p.add_argument("--tests", default=None,
                   help=f"reference path: comma list of {','.join(TESTS)} (--gate: ppl)")
    p.add_argument("--tokens", type=int, default=None, help="ppl sequence length (default 4096, quick 512)")
    p.add_argument("--gsm-problems", type=int, default=None, help="gsm_symbolic problems (default 12, quick 1)")
    p.add_argument("--greedy-tokens", type=int, default=None, help="greedy generation length (default 1024, quick 160)")
    p.add_argument("--window", type=int, default=None,
                   help="recent window (engine mode default 32; reference path default 128, quick 32)")
    p.add_argument("--selection", choices=("per_head", "per_layer_per_head"), default="per_head",
                   help="keep-set selection (default per_head, the paper's)")
    p.add_argument("--gate", action="store_true", help="exit 1 if a gated policy/budget loses more than --tolerance")
    p.add_argument("--tolerance", type=float, default=0.10,
                   help="allowed relative perplexity increase over full attention on the ppl slice (default 0.10)")
    p.add_argument("--gate-policy", default=None, help="policy the gate checks (default: the first policy)")
    p.add_argument("--gate-budgets", default=None, help="budgets the gate checks (default: all budgets)")
    p.add_argument("--calibrate", action="store_true", help="make the TriAttention stats if missing")
    p.add_argument("--model", default=None,
                   help="a transformers model folder to measure (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--stats", default=None,
                   help="TriAttention statistics for --model (`kvcompact calibrate`); checked against the model")


class _Env:
    def __init__(self, ctx: Any) -> None:
        import torch
        from transformers import AutoTokenizer

        from kvcompact import reference
        from kvcompact.tools.corpus import eval_text
        from kvcompact.tools.model import ensure_default_model

        torch.manual_seed(0)
        self.ctx = ctx
        a = ctx.args
        model_dir = a.model or str(ensure_default_model())
        self.reference = reference  # the transformers reference path every --tests cell runs through
        self.model = reference.load_model(model_dir, dtype=torch.float32)
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.text_ids = self.tok(eval_text().read_text())["input_ids"]
        self.stats_path: str | None = None
        self.window = a.window if a.window is not None else (32 if ctx.quick else 128)

    def config(self, policy: str, budget: int) -> Any:
        from kvcompact.config import KVCompactConfig
        from kvcompact.tools.bench import FIXED_ROUNDS

        return KVCompactConfig(**FIXED_ROUNDS, policy=policy, budget=budget, window=self.window, compaction="repack",
                               selection=self.ctx.args.selection,
                               stats_path=self.stats_path if policy == "triattention" else None)

    def nll(self, ids: list[int], policy: str | None, budget: int | None, prefix: int) -> Any:
        cfg = None if policy is None else self.config(policy, budget)
        return self.reference.teacher_forced_nll(self.model, ids, cfg, prefix_len=prefix)


def run(ctx: Any) -> dict[str, Any]:
    a = ctx.args
    if a.tests is None and not a.gate:
        return _engine_mode().run(ctx)
    if a.tasks is not None:
        raise UsageError("--tasks (engine mode) and --tests (reference path) are separate runs",
                         command="bench accuracy")
    env = _Env(ctx)
    if a.model or a.stats:
        env.stats_path = _checked_stats(env.model, a.stats)
        why = f"statistics {a.stats}" if a.stats else "no --stats for --model"
    else:
        _, env.stats_path, why = ctx.scoring_policy(None)
    ctx.notes.append(f"model {a.model or 'bundled'}; scoring policy: {why}")
    policies = (a.policies or ("triattention,streaming" if ctx.quick else
                               "triattention,streaming,knorm,random,snapkv")).split(",")
    if "triattention" in policies and env.stats_path is None:
        policies = [p for p in policies if p != "triattention"]
        ctx.notes.append("triattention skipped: no statistics")
    budgets = [int(b) for b in (a.budgets or ("64,128" if ctx.quick else "256,512,1024")).split(",")]
    tests = (a.tests or ("ppl" if a.gate else ",".join(TESTS))).split(",")
    gate_policy = a.gate_policy or policies[0]
    if a.gate and gate_policy not in policies:
        policies = [gate_policy] + policies
    cells = [(p, b) for p in policies for b in budgets]
    out: dict[str, Any] = {"setup": {"policies": policies, "budgets": budgets, "tests": tests,
                                     "window": env.window, "selection": a.selection, "dtype": "float32",
                                     "divide_length": 128}}
    timings: dict[str, float] = {}
    for test in tests:
        t0 = time.perf_counter()
        out[test] = globals()[f"_test_{test}"](ctx, env, cells)
        timings[test] = round(time.perf_counter() - t0, 1)
        ctx.checkpoint(out)
        ctx.log(f"{test}: done in {timings[test]} s")
    out["seconds"] = timings
    out["headline"] = _headline(out, policies, budgets)
    if a.gate:
        out["gate"] = _gate(ctx, out, gate_policy, a)
        out["headline"]["gate"] = out["gate"]
    _plot(ctx, out, policies, budgets)
    return out


def _checked_stats(model: Any, path: str | None) -> str | None:
    """The statistics file for ``--model``, refused before any test runs when it describes another model (the
    reference path would otherwise fail mid-run on a shape, or score with the wrong queries)."""
    if path is None:
        return None
    from kvcompact.stats import ModelFingerprint, StatsError, load_stats

    try:  # the fingerprint the plugin checks at start-up (kvcompact.vllm.startup.load_stats)
        load_stats(path, ModelFingerprint.from_hf_config(model.config))
    except (OSError, StatsError) as e:
        raise UsageError(f"--stats {path}: {e}", command="bench accuracy") from None
    return path


# ----------------------------------------------------------------------------------------------------- tests
def _test_ppl(ctx: Any, env: _Env, cells: list) -> dict[str, Any]:
    n = ctx.args.tokens or (512 if ctx.quick else 4096)
    ids = env.text_ids[:n]
    prefix = 64
    lo = n // 2  # evaluation slice: tokens lo..n (every budget has evicted by then)
    res: dict[str, Any] = {"tokens": n, "prefix": prefix, "slice": [lo, n], "cells": {}}
    bar = ctx.progress(total=len(cells) + 1, desc="ppl")
    full = env.nll(ids, None, None, prefix)
    bar.update()
    sl = slice(lo - prefix, None)  # nll[i] is the loss of token prefix + i
    res["full"] = math.exp(float(full[sl].mean()))
    for p, b in cells:
        nll = env.nll(ids, p, b, prefix)
        ppl = math.exp(float(nll[sl].mean()))
        res["cells"][f"{p}@{b}"] = {"ppl": ppl, "rel_increase": ppl / res["full"] - 1}
        bar.update()
    bar.close()
    return res


def _test_repeat(ctx: Any, env: _Env, cells: list) -> dict[str, Any]:
    filler_n = 192 if ctx.quick else 1500
    plen = 64 if ctx.quick else 256
    passage = env.text_ids[-2000:-2000 + plen]       # a passage from the end of the text
    filler = env.text_ids[:filler_n]
    prefix = 64
    ids = filler[:prefix] + passage + filler[prefix:] + passage
    second = len(ids) - len(passage)
    sl = slice(second + 8 - prefix, None)            # skip the first 8 tokens of the copy (the cue)
    res: dict[str, Any] = {"passage_tokens": len(passage), "distance": second - prefix, "cells": {}}
    bar = ctx.progress(total=len(cells) + 1, desc="repeat")
    full = env.nll(ids, None, None, prefix)
    first = slice(8, len(passage))
    res["first_copy_ppl"] = math.exp(float(full[first].mean()))
    res["full"] = math.exp(float(full[sl].mean()))
    bar.update()
    for p, b in cells:
        nll = env.nll(ids, p, b, prefix)
        res["cells"][f"{p}@{b}"] = {"ppl": math.exp(float(nll[sl].mean()))}
        bar.update()
    bar.close()
    return res


def _test_passkey(ctx: Any, env: _Env, cells: list) -> dict[str, Any]:
    import random

    distances = [96, 256] if ctx.quick else [256, 768, 1536, 2560]
    keys_per = 1 if ctx.quick else 3
    total = max(distances) + (96 if ctx.quick else 256)
    rng = random.Random(0)
    filler = env.text_ids[4000:4000 + total]
    cases = []
    for d in distances:
        for _ in range(keys_per):
            key = str(rng.randint(10000, 99999))
            needle = env.tok(f" The pass key is {key}. Remember it. {key} is the pass key. ")["input_ids"]
            question = env.tok(" What is the pass key? The pass key is")["input_ids"]
            answer = env.tok(f" {key}")["input_ids"]
            head = filler[: total - d]
            tail = filler[total - d: total - d + d - len(question)]
            ids = head + needle + tail + question + answer
            cases.append({"distance": d, "key": key, "ids": ids, "answer_len": len(answer)})
    res: dict[str, Any] = {"distances": distances, "keys_per_distance": keys_per, "cells": {}}
    configs = [("full", None, None)] + [(f"{p}@{b}", p, b) for p, b in cells]
    bar = ctx.progress(total=len(configs) * len(cases), desc="passkey")
    for name, p, b in configs:
        hits: dict[int, list[bool]] = {d: [] for d in distances}
        for c in cases:
            ids, n_ans = c["ids"], c["answer_len"]
            # as the server does it: the prompt is prefilled, the first token comes from the prefill, then a
            # round compresses the cache to the budget before every further token
            toks, _ = env.reference.generate(env.model, ids[:-n_ans], n_ans, None if p is None else env.config(p, b))
            ok = toks == ids[-n_ans:]
            hits[c["distance"]].append(ok)
            bar.update()
        cell = {"by_distance": {d: sum(v) / len(v) for d, v in hits.items()},
                "success": sum(sum(v) for v in hits.values()) / len(cases)}
        if name == "full":
            res["full"] = cell
        else:
            res["cells"][name] = cell
    bar.close()
    return res


def _test_greedy(ctx: Any, env: _Env, cells: list) -> dict[str, Any]:
    n_new = ctx.args.greedy_tokens or (160 if ctx.quick else 1024)
    prompt = env.text_ids[8000:8000 + (64 if ctx.quick else 128)]
    # only budgets that run at least one round in this length
    cells = [(p, b) for p, b in cells if len(prompt) + n_new > b + 128 + 16]
    bar = ctx.progress(total=len(cells) + 1, desc="greedy")
    full, _ = env.reference.generate(env.model, prompt, n_new, None)
    bar.update()
    res: dict[str, Any] = {"prompt_tokens": len(prompt), "new_tokens": n_new, "cells": {}}
    for p, b in cells:
        toks, rounds = env.reference.generate(env.model, prompt, n_new, env.config(p, b))
        div = next((i for i, (x, y) in enumerate(zip(full, toks)) if x != y), None)
        first_round = rounds[0].logical_len - len(prompt) if rounds else None
        same = sum(x == y for x, y in zip(full, toks))
        res["cells"][f"{p}@{b}"] = {"first_divergence": div, "identical_share": same / n_new,
                                    "rounds": len(rounds), "first_round_at_token": first_round}
        bar.update()
    bar.close()
    return res


_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _extract(text: str) -> str | None:
    m = re.search(r"####\s*(-?[\d,\.]+)", text)
    if m:
        return m.group(1).replace(",", "").rstrip(".")
    nums = _NUM.findall(text.split("\n\n")[0])
    return nums[-1].replace(",", "") if nums else None


def _test_gsm(ctx: Any, env: _Env, cells: list) -> dict[str, Any]:
    try:
        import reasoning_gym
    except ImportError:
        ctx.notes.append("gsm skipped: reasoning-gym is not installed (pip install -e '.[bench]')")
        return {"skipped": "reasoning-gym not installed", "cells": {}}

    n_prob = ctx.args.gsm_problems or (1 if ctx.quick else 12)
    n_shots = 2 if ctx.quick else 4
    shots = reasoning_gym.create_dataset("gsm_symbolic", size=n_shots, seed=1234)
    problems = reasoning_gym.create_dataset("gsm_symbolic", size=n_prob, seed=42)
    fewshot = "".join(f"Question: {s['question']}\nAnswer: {s['metadata']['answer_cot']}\n\n" for s in shots)
    max_new = 32 if ctx.quick else 160
    # the prompt (~1k tokens; quick ~500) exceeds the two smallest budgets: only those change anything here
    budgets = sorted({b for _, b in cells})[:2]
    cells = [(p, b) for p, b in cells if b in budgets]
    res: dict[str, Any] = {"problems": n_prob, "shots": n_shots, "max_new_tokens": max_new, "budgets": budgets,
                           "cells": {}}
    configs = [("full", None, None)] + [(f"{p}@{b}", p, b) for p, b in cells]
    answers: dict[str, list[str | None]] = {}
    correct: dict[str, list[float]] = {}
    lens = []
    bar = ctx.progress(total=len(configs) * n_prob, desc="gsm")
    for i in range(n_prob):
        item = problems[i]
        ids = env.tok(fewshot + f"Question: {item['question']}\nAnswer:")["input_ids"]
        lens.append(len(ids))
        for name, p, b in configs:
            cfg = None if p is None else env.config(p, b)
            toks, _ = env.reference.generate(env.model, ids, max_new, cfg)
            text = env.tok.decode(toks)
            ans = _extract(text)
            answers.setdefault(name, []).append(ans)
            correct.setdefault(name, []).append(float(problems.score_answer(ans, item)) if ans else 0.0)
            bar.update()
    bar.close()
    res["prompt_tokens_median"] = sorted(lens)[len(lens) // 2]
    res["full"] = {"accuracy": sum(correct["full"]) / n_prob, "answers": answers["full"]}
    for name, _, _ in configs[1:]:
        changed = sum(x != y for x, y in zip(answers["full"], answers[name]))
        res["cells"][name] = {"answer_change_rate": changed / n_prob, "accuracy": sum(correct[name]) / n_prob,
                              "answers": answers[name]}
    return res


# ----------------------------------------------------------------------------------------------------- report
def _headline(out: dict[str, Any], policies: list[str], budgets: list[int]) -> dict[str, Any]:
    h: dict[str, Any] = {}
    if "ppl" in out:
        h["ppl_full"] = round(out["ppl"]["full"], 3)
        h["ppl"] = {k: round(v["ppl"], 3) for k, v in out["ppl"]["cells"].items()}
    if "repeat" in out:
        h["repeat_ppl_full"] = round(out["repeat"]["full"], 3)
        h["repeat_first_copy_ppl"] = round(out["repeat"]["first_copy_ppl"], 3)
        h["repeat_ppl"] = {k: round(v["ppl"], 3) for k, v in out["repeat"]["cells"].items()}
    if "passkey" in out:
        h["passkey_full"] = out["passkey"]["full"]["success"]
        h["passkey"] = {k: v["success"] for k, v in out["passkey"]["cells"].items()}
    if "greedy" in out:
        h["greedy_identical_share"] = {k: round(v["identical_share"], 3) for k, v in out["greedy"]["cells"].items()}
        h["greedy_first_divergence"] = {k: v["first_divergence"] for k, v in out["greedy"]["cells"].items()}
    if "gsm" in out and "full" in out["gsm"]:
        h["gsm_full_accuracy"] = out["gsm"]["full"]["accuracy"]
        h["gsm_answer_change_rate"] = {k: v["answer_change_rate"] for k, v in out["gsm"]["cells"].items()}
    return h


def _gate(ctx: Any, out: dict[str, Any], policy: str, a: Any) -> dict[str, Any]:
    if "ppl" not in out:
        raise UsageError("--gate needs the ppl test (add it to --tests)", command="bench accuracy")
    budgets = [int(b) for b in a.gate_budgets.split(",")] if a.gate_budgets else out["setup"]["budgets"]
    checks = []
    for b in budgets:
        cell = out["ppl"]["cells"].get(f"{policy}@{b}")
        if cell is None:
            continue
        ok = cell["rel_increase"] <= a.tolerance
        checks.append({"policy": policy, "budget": b, "ppl": cell["ppl"], "ppl_full": out["ppl"]["full"],
                       "rel_increase": cell["rel_increase"], "tolerance": a.tolerance, "pass": ok})
        ctx.log(f"gate {policy}@{b}: ppl {cell['ppl']:.3f} vs full {out['ppl']['full']:.3f} "
                f"(+{100 * cell['rel_increase']:.1f}%, tolerance {100 * a.tolerance:.1f}%): {'PASS' if ok else 'FAIL'}")
    passed = bool(checks) and all(c["pass"] for c in checks)
    if not passed:
        ctx.exit_code = 1
    return {"pass": passed, "slice": out["ppl"]["slice"], "checks": checks}


def _plot(ctx: Any, out: dict[str, Any], policies: list[str], budgets: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [t for t in ("ppl", "repeat", "passkey", "greedy", "gsm")
              if t in out["setup"]["tests"] and out[t].get("cells")]
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    colors = dict(zip(["triattention", "streaming", "knorm", "random", "snapkv", "h2o", "rkv"],
                      ["tab:blue", "tab:orange", "tab:green", "tab:gray", "tab:purple", "tab:brown", "tab:pink"]))
    spec = {
        "ppl": ("perplexity (Britannica, 2nd half)", lambda c: c["ppl"], lambda r: r["full"]),
        "repeat": ("perplexity of the repeated passage", lambda c: c["ppl"], lambda r: r["full"]),
        "passkey": ("passkey retrieval success (share)", lambda c: c["success"], lambda r: r["full"]["success"]),
        "greedy": ("share of tokens identical to full attn.", lambda c: c["identical_share"], lambda r: 1.0),
        "gsm": ("gsm_symbolic answer-change rate vs full", lambda c: c["answer_change_rate"], lambda r: 0.0),
    }
    for ax, test in zip(axes.flat, panels):
        title, get, full = spec[test]
        r = out[test]
        for p in policies:
            xs = [b for b in budgets if f"{p}@{b}" in r["cells"]]
            if xs:
                ax.plot(xs, [get(r["cells"][f"{p}@{b}"]) for b in xs], "o-", color=colors.get(p), label=p)
        ax.axhline(full(r), color="k", ls="--", lw=1, label="full attention")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("budget (tokens per KV head)")
        ax.set_ylabel(title, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    ctx.savefig(fig)
