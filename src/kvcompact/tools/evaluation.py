"""Generation quality through the engine: tasks, grading and the statistics that compare a cell to full attention.

Used by the benchmarks that grade answers (``kvcompact bench accuracy`` in engine mode, ``answers``, ``pressure``,
``speculative``, ``longgen``). A *task* builds chat messages with a fixed seed and grades a completion; a *cell* is
one way to serve a request (full attention, or a policy at a budget), carried per request in
``SamplingParams.extra_args`` exactly as a client sends ``vllm_xargs``. The report set uses :data:`REPORT_SEED`;
anything tuned is tuned on :data:`EXPLORE_SEED`, never on the problems that are reported. Each task's function says
which regime it checks and why; the results are in BENCHMARKS.md.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcompact.vllm.metrics import loops

REPORT_SEED = 2026
EXPLORE_SEED = 7
TASKS = ("reasoning", "passkey", "recall")  # kvcompact bench accuracy's tasks; `chain` is kvcompact bench longgen's
NONINFERIORITY_MARGIN = 0.02
_Z = 1.959963984540054  # two-sided 95%


@dataclass
class Item:
    """One prompt of a task and what grading it needs."""

    id: str
    messages: list[dict[str, str]]
    max_tokens: int
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Task:
    name: str
    items: list[Item]
    grade: Callable[[Item, str], tuple[bool, str | None]]


# ---------------------------------------------------------------------------------------------------- tasks
_ANSWER = re.compile(r"answer\s*(?:is)?\s*[:=]?\s*\**\s*\$?\s*(-?[\d,]*\.?\d+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_number(text: str) -> str | None:
    """The final answer of a chain of thought: the number after the last "Answer:" (or "answer is"), else the
    last number of the text, else the last boxed one; commas and a trailing ".0" dropped."""
    found = _ANSWER.findall(text) or re.findall(r"\\boxed\{\s*\$?(-?[\d,]*\.?\d+)", text) or _NUMBER.findall(text)
    if not found:
        return None
    value = found[-1].replace(",", "").rstrip(".")
    return value[:-2] if value.endswith(".0") else value


def reasoning_task(n: int, seed: int = REPORT_SEED, max_tokens: int = 1024) -> Task:
    """reasoning-gym ``gsm_symbolic`` grade-school problems, zero-shot chain of thought in the chat template: the
    regime TriAttention targets (short prompt, long decode, rounds during the reasoning)."""
    import reasoning_gym

    data = reasoning_gym.create_dataset("gsm_symbolic", size=n, seed=seed)
    items = []
    for i in range(n):
        entry = data[i]
        prompt = (f"{entry['question']}\n\nSolve the problem step by step. End with a line of the form "
                  "'Answer: <number>'.")
        items.append(Item(f"reasoning-{seed}-{i}", [{"role": "user", "content": prompt}], max_tokens,
                          str(entry["answer"])))

    def grade(item: Item, text: str) -> tuple[bool, str | None]:
        got = extract_number(text)
        return got is not None and _same_number(got, item.answer), got

    return Task("reasoning", items, grade)


def _same_number(a: str, b: str) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=0, abs_tol=1e-6)
    except ValueError:
        return a.strip() == b.strip()


def passkey_task(n: int, haystack: Sequence[str], seed: int = REPORT_SEED, min_words: int = 1500,
                 max_words: int = 2600) -> Task:
    """A 5-digit pass key hidden in a long haystack: the prompt-compression regime (the prompt itself overflows
    the budget). ``haystack``: the words of a long public-domain text; each item takes a random slice of
    1.5k-2.6k words (about 2k-3.5k tokens) and hides the key at a uniformly random depth."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        words = rng.randint(min_words, max_words)
        start = rng.randrange(0, max(1, len(haystack) - words))
        text = list(haystack[start:start + words])
        key = str(rng.randint(10000, 99999))
        depth = rng.random()
        text.insert(int(depth * len(text)), f"The pass key is {key}. Remember it. {key} is the pass key.")
        prompt = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
                  + " ".join(text) + "\n\nWhat is the pass key? Reply with the number only.")
        items.append(Item(f"passkey-{seed}-{i}", [{"role": "user", "content": prompt}], 16, key,
                          {"depth": round(depth, 3), "words": words}))

    def grade(item: Item, text: str) -> tuple[bool, str | None]:
        found = re.findall(r"\d{5}", text)
        return bool(found) and found[0] == item.answer, found[0] if found else None

    return Task("passkey", items, grade)


def recall_task(n: int, seed: int = REPORT_SEED, count_to: int = 150, max_tokens: int = 1024) -> Task:
    """A code given first, then the model counts to ``count_to`` (150: about 700 generated tokens) and must repeat
    the code. The answer depends on text far back in a long generation, which nothing attends to while counting,
    so it checks that a score-based policy keeps what is needed later, not only what is attended now."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        code = f"{rng.choice(_WORDS)}-{rng.randint(100, 999)}"
        prompt = (f"Remember this code: {code}.\n\nFirst, count from 1 to {count_to}, writing the numbers separated "
                  "by commas. Then, on a new line, write 'Code: ' followed by the code you were asked to "
                  "remember.")
        items.append(Item(f"recall-{seed}-{i}", [{"role": "user", "content": prompt}], max_tokens, code,
                          {"count_to": count_to}))

    def grade(item: Item, text: str) -> tuple[bool, str | None]:
        counted = str(item.meta["count_to"]) in text.split("Code")[0]
        found = re.findall(r"Code:\s*\**\s*([A-Za-z]+-\d{3})", text)
        got = found[-1] if found else None
        return counted and got == item.answer, got

    return Task("recall", items, grade)


def chain_task(n: int, per_answer: int, seed: int = REPORT_SEED, max_tokens: int = 4096) -> Task:
    """``n`` prompts of ``per_answer`` grade-school problems each (distinct problems throughout); an item's
    ``answer`` is its results joined by "; " and ``meta["answers"]`` lists them. ``grade`` is true when every
    restated result is right; :func:`chain_units` grades the problems one by one, twice: the result given in place
    and the result restated at the end.

    Why: each problem is read from the prompt only when the answer reaches it (hundreds to thousands of tokens
    after the prompt), and the last line copies results generated far back: the two things a round can drop that
    the rest of a long generation still needs."""
    import reasoning_gym

    data = reasoning_gym.create_dataset("gsm_symbolic", size=n * per_answer, seed=seed)
    items = []
    for i in range(n):
        entries = [data[i * per_answer + k] for k in range(per_answer)]
        problems = "\n\n".join(f"Problem {k + 1}: {e['question']}" for k, e in enumerate(entries))
        example = "; ".join(f"<answer {k + 1}>" for k in range(per_answer))
        prompt = (f"Solve the following {per_answer} problems one after another. For each problem, write the "
                  "heading 'Problem k', reason step by step, and end that part with a line of the form "
                  "'Answer k: <number>'. After the last problem, write one final line that restates every "
                  f"answer in order, in the form 'Final answers: {example}'.\n\n{problems}")
        answers = [str(e["answer"]) for e in entries]
        items.append(Item(f"chain-{seed}-{i}", [{"role": "user", "content": prompt}], max_tokens,
                          "; ".join(answers), {"answers": answers}))

    def grade(item: Item, text: str) -> tuple[bool, str | None]:
        final = _final_line(text)
        return all(restated for restated, _ in chain_units(item, text)), final

    return Task("chain", items, grade)


_FINAL = re.compile(r"final answers?\s*:\s*\**\s*(.*)", re.IGNORECASE)


def _final_line(text: str) -> str | None:
    found = _FINAL.findall(text)
    return found[-1].strip() if found else None


def answer_line(k: int | None = None) -> re.Pattern[str]:
    """A chain item's "Answer k:" line, its number in group 1 (``**`` and ``$`` around it allowed); k None: any k.
    The one pattern :func:`chain_units` grades with and ``bench/longgen.py`` locates results with."""
    number = r"\d+" if k is None else str(k)
    return re.compile(rf"answer\s*{number}\s*:\s*\**\s*\$?\s*(-?[\d,]*\.?\d+)", re.IGNORECASE)


def chain_units(item: Item, text: str) -> list[tuple[bool, bool]]:
    """Per problem of a ``chain`` item: (restated right, given right in place). Restated: the k-th entry of the
    last "Final answers:" line, entries separated by ";" (a number's own commas are thousands separators).
    In place: the number on the last "Answer k:" line for that k."""
    return [(restated is not None and _first_number_is(restated, truth),
             in_place is not None and _first_number_is(in_place, truth))
            for (restated, in_place), truth in zip(_chain_results(item, text), item.meta["answers"])]


def chain_copies(item: Item, text: str) -> list[bool | None]:
    """Per problem of a ``chain`` item: whether the last "Final answers:" line restates the number the answer gave in
    place, right or wrong (None: no "Answer k:" line). The part of the restated grade that is the cache's alone:
    a result generated far back, copied, whatever the arithmetic that made it."""
    return [None if in_place is None else
            restated is not None and _first_number_is(restated, in_place.replace(",", ""))
            for restated, in_place in _chain_results(item, text)]


def _chain_results(item: Item, text: str) -> list[tuple[str | None, str | None]]:
    """Per problem k of a ``chain`` item: the k-th entry of the last "Final answers:" line and the number on the
    last "Answer k:" line (None where absent): what :func:`chain_units` and :func:`chain_copies` grade."""
    final = _final_line(text)
    entries = [] if final is None else final.split(";")
    out: list[tuple[str | None, str | None]] = []
    for k in range(len(item.meta["answers"])):
        in_place = answer_line(k + 1).findall(text)
        out.append((entries[k] if k < len(entries) else None, in_place[-1] if in_place else None))
    return out


def _first_number_is(text: str, truth: str) -> bool:
    found = _NUMBER.findall(text)
    if not found:
        return False
    value = found[0].replace(",", "").rstrip(".")
    return _same_number(value[:-2] if value.endswith(".0") else value, truth)


_WORDS = ("amber", "falcon", "granite", "harbor", "juniper", "lantern", "meadow", "nickel", "orchid", "pepper",
          "quartz", "raven", "saffron", "timber", "velvet", "walnut", "zephyr", "cobalt", "ember", "fjord")


def prompt_ids(tokenizer: Any, item: Item) -> list[int]:
    """The item's chat, templated for generation as the OpenAI chat endpoint does it."""
    ids = tokenizer.apply_chat_template(item.messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


# -------------------------------------------------------------------------------------------------- statistics
def wilson(k: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of k successes in n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    denom = 1 + _Z**2 / n
    centre = (p + _Z**2 / (2 * n)) / denom
    half = _Z * math.sqrt(p * (1 - p) / n + _Z**2 / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_difference(full: Sequence[bool], cell: Sequence[bool]) -> dict[str, Any]:
    """Cell accuracy minus full attention's on the same items, with a 95% interval (Agresti-Min adjusted Wald
    for paired proportions: 0.5 added to each cell of the 2x2 table) and the non-inferiority verdict: the cell
    is "no worse than full by more than 2 points" when the interval's lower end is above -0.02."""
    if len(full) != len(cell):
        raise ValueError("paired comparison needs the same items on both sides")
    n = len(full)
    only_full = sum(f and not c for f, c in zip(full, cell))
    only_cell = sum(c and not f for f, c in zip(full, cell))
    diff = (only_cell - only_full) / n if n else 0.0
    b, c, m = only_full + 0.5, only_cell + 0.5, n + 2.0
    d = (c - b) / m
    se = math.sqrt(max(0.0, (b + c) - (c - b) ** 2 / m)) / m
    low, high = d - _Z * se, d + _Z * se
    return {"diff": diff, "ci95": [low, high], "only_full": only_full, "only_cell": only_cell,
            "noninferior": low > -NONINFERIORITY_MARGIN}



def summarize(task: Task, cell: str, texts: dict[str, str], tokens: dict[str, list[int]],
              rounds: dict[str, int], full: dict[str, tuple[bool, str | None]] | None) -> dict[str, Any]:
    """Per-cell report: accuracy with its Wilson interval, the paired comparison with full attention (``full``:
    item id -> (correct, answer)) and the share of items answered the same, completion lengths (mean, p95),
    completions that hit the cap or loop, rounds per request."""
    correct: dict[str, bool] = {}
    answers: dict[str, str | None] = {}
    for item in task.items:
        correct[item.id], answers[item.id] = task.grade(item, texts[item.id])
    n = len(task.items)
    k = sum(correct.values())
    token_counts = sorted(len(tokens[i.id]) for i in task.items)
    out: dict[str, Any] = {
        "cell": cell, "n": n, "correct": k, "accuracy": k / n if n else 0.0, "ci95": list(wilson(k, n)),
        "mean_tokens": sum(token_counts) / n if n else 0.0,
        "p95_tokens": token_counts[min(n - 1, math.ceil(0.95 * n) - 1)] if n else 0,
        "at_cap": sum(len(tokens[i.id]) >= i.max_tokens for i in task.items),
        "looping": sum(loops(tokens[i.id]) for i in task.items),
        "rounds_per_request": sum(rounds.get(i.id, 0) for i in task.items) / n if n else 0.0,
        "correct_by_item": correct, "answers": answers,
    }
    if full is not None:
        out["paired"] = paired_difference([full[i.id][0] for i in task.items], [correct[i.id] for i in task.items])
        out["agreement"] = sum(full[i.id][1] == answers[i.id] for i in task.items) / n if n else 0.0
    return out


__all__ = ["Item", "Task", "TASKS", "REPORT_SEED", "EXPLORE_SEED", "reasoning_task", "passkey_task", "recall_task",
           "chain_task", "chain_units", "chain_copies", "answer_line",
           "prompt_ids", "extract_number", "wilson", "paired_difference", "loops", "summarize"]
