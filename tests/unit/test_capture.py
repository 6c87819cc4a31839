"""The worker's attention capture (:mod:`kvcompact.vllm.capture`) on a fake runner: row -> request mapping,
query rings, H2O accumulation against a direct NumPy loop, moves, resets. The real engine path is covered by
tests/engine/test_engine_policies.py; this pins the bookkeeping in milliseconds."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvcompact.moves import plan_moves
from kvcompact.vllm.capture import AttentionCapture
from kvcompact.vllm.kv_layout import CpuAttnVecLayout, phys_slots
from kvcompact.vllm.paged_kv import PagedKV

L, HKV, HQ, D, BS, W = 2, 2, 4, 8, 4, 3


class FakeImpl:
    def __init__(self) -> None:
        self.calls = 0

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        self.calls += 1
        return output


class World:
    """A runner with two layers of CPU_ATTN cache; ``step`` writes the rows' keys and runs every layer's impl."""

    def __init__(self, queries=True, accum=True, spec_tokens=0):
        self.layout = CpuAttnVecLayout(BS, HKV, D)
        self.kv = [torch.zeros(self.layout.shape(16)) for _ in range(L)]
        self.requests: dict[str, SimpleNamespace] = {}
        self.layers = [SimpleNamespace(impl=FakeImpl()) for _ in range(L)]
        self.runner = SimpleNamespace(kv_caches=self.kv, requests=self.requests, input_batch=None)
        kv = PagedKV(self.runner, self.layout, lambda _layer, k: k.float())
        self.cap = AttentionCapture(requests={}, kv=kv, num_layers=L, num_q_heads=HQ, query_window=W, queries=queries,
                                    attn_accum=accum, spec_tokens=spec_tokens)
        self.cap.install(list(enumerate(self.layers)))
        self.rng = np.random.default_rng(0)
        self.next_block = 1
        self.keys: dict[str, list[np.ndarray]] = {}   # per request, per cache slot: [L, HKV, D]
        self.queries: dict[str, list[np.ndarray]] = {}  # per request, every query row: [L, HQ, D]
        self.computed: dict[str, int] = {}
        self.evicted: dict[str, int] = {}

    def add(self, rid, prompt_len):
        # num_tokens: prompt + sampled tokens, as the runner's CachedRequestState counts them
        self.requests[rid] = SimpleNamespace(num_prompt_tokens=prompt_len, num_tokens=prompt_len, block_ids=[[]])
        self.keys[rid], self.queries[rid], self.computed[rid] = [], [], 0

    def step(self, sched: dict[str, int], kept: dict[str, int] | None = None):
        """Run one forward of ``sched[r]`` rows per request. ``kept[r]``: rows the target accepted when the rows
        past the request's known tokens are speculative drafts (default: all); the others roll back, as vLLM's
        ``num_computed_tokens`` does."""
        rids = list(sched)
        counts = np.array([sched[r] for r in rids])
        self.runner.input_batch = SimpleNamespace(
            num_reqs=len(rids), req_ids=rids,
            num_computed_tokens_cpu=np.array([self.computed[r] for r in rids]))
        qrows, decode = [], []
        for r in rids:
            n = sched[r]
            cache_start = self.computed[r] - self.evicted.get(r, 0)
            if cache_start == 0:
                self.keys[r] = []
            blocks = self.requests[r].block_ids[0]
            while len(blocks) * BS < cache_start + n:
                blocks.append(self.next_block)
                self.next_block += 1
            for i in range(n):
                k = self.rng.standard_normal((L, HKV, D)).astype(np.float32)
                q = self.rng.standard_normal((L, HQ, D)).astype(np.float32)
                slot = cache_start + i
                phys = phys_slots(torch.tensor(blocks), torch.tensor([slot]), BS).expand(HKV, 1)
                for layer in range(L):
                    self.layout.scatter(self.kv[layer], phys, torch.tensor(k[layer])[:, None],
                                        torch.zeros(HKV, 1, D))
                if slot < len(self.keys[r]):
                    self.keys[r][slot] = k
                else:
                    self.keys[r].append(k)
                self.queries[r].append(q)
                qrows.append(q)
            if n == 1 and self.computed[r] == self.requests[r].num_tokens - 1 and self.computed[r] >= \
                    self.requests[r].num_prompt_tokens:
                decode.append(r)
        self.cap.begin_step(())
        self.cap.begin_forward(counts, dict(self.evicted))
        q_all = np.stack(qrows)  # [T, L, HQ, D]
        for layer in range(L):
            self.layers[layer].impl.forward(self.layers[layer], torch.tensor(q_all[:, layer]), None, None,
                                            self.kv[layer], object(), output=None)
        for r in rids:
            n = (kept or {}).get(r, sched[r])
            del self.queries[r][len(self.queries[r]) - sched[r] + n:]
            del self.keys[r][self.computed[r] - self.evicted.get(r, 0) + n:]
            known = self.requests[r].num_tokens
            self.computed[r] += n
            if self.computed[r] >= known:  # every known token fed: the accepted drafts and one more are sampled
                self.requests[r].num_tokens = self.computed[r] + 1
        return decode


def np_step_attention(keys: list[np.ndarray], q: np.ndarray) -> np.ndarray:
    """[L, HKV, N]: softmax(q k / sqrt(d)) over all cached slots, summed over each GQA group (loops)."""
    N = len(keys)
    out = np.zeros((L, HKV, N))
    g = HQ // HKV
    for layer in range(L):
        for hq in range(HQ):
            h = hq // g
            logits = np.array([float(q[layer, hq] @ keys[n][layer, h]) / math.sqrt(D) for n in range(N)])
            p = np.exp(logits - logits.max())
            out[layer, h] += p / p.sum()
    return out


def test_queries_ring_holds_the_last_w_rows_in_order_prefill_included():
    w = World(accum=False)
    w.add("a", 5)
    w.add("b", 2)
    w.step({"a": 5, "b": 2})          # prefill rows count (b has fewer than w so far)
    w.step({"a": 1, "b": 1})
    got = w.cap.queries_for(["a", "b"], [w.computed["a"], w.computed["b"]])  # [B, L, HQ, W, D]
    for b, r in enumerate("ab"):
        want = np.stack(w.queries[r][-W:], axis=2)  # [L, HQ, W, D]
        np.testing.assert_array_equal(got[b].numpy(), want)
    # a feature that is off is never fed
    assert all(s.sums is None for s in w.cap.requests.values()) and w.cap.decode_rows == 0
    w.step({"a": 1})
    np.testing.assert_array_equal(w.cap.queries_for(["a"], [w.computed["a"]])[0].numpy(),
                                  np.stack(w.queries["a"][-W:], axis=2))
    # a request with fewer than w rows cannot feed a window
    w.add("c", 1)
    w.step({"c": 1})
    with pytest.raises(RuntimeError, match="captured query rows"):
        w.cap.queries_for(["c"], [w.computed["c"]])


def test_accumulator_sums_decode_attention_only_and_matches_numpy():
    w = World(queries=False)
    w.add("a", 4)
    w.add("b", 6)
    w.step({"a": 4, "b": 3})           # a: whole prompt; b: first chunk
    want = {"a": np.zeros((L, HKV, 4)), "b": np.zeros((L, HKV, 3))}
    for _ in range(3):
        sched = {"a": 1, "b": 3} if w.computed["b"] < 6 else {"a": 1, "b": 1}
        decode = w.step(sched)
        for r in sched:
            want[r] = np.concatenate([want[r], np.zeros((L, HKV, sched[r]))], axis=-1)
        for r in decode:
            want[r] += np_step_attention(w.keys[r], w.queries[r][-1])
    assert w.cap.decode_rows == 3 + 2   # b's second prompt chunk is not a decode row
    for r in "ab":
        n = len(w.keys[r])
        got = w.cap.accum_for([r], [n], n + 2)[0]
        np.testing.assert_allclose(got[..., :n].numpy(), want[r], rtol=1e-5, atol=1e-6)
        assert not got[..., n:].any()
    # prompt attention is never accumulated: a's first 4 slots only got decode rows' attention (> 0)
    assert (w.cap.accum_for(["a"], [7], 7)[0] > 0).all()
    with pytest.raises(RuntimeError, match="holds 7 slots, the cache 6"):
        w.cap.accum_for(["a"], [6], 7)


def test_accumulator_moves_with_the_plan_and_resets_on_a_new_cache():
    w = World(queries=True)
    w.add("a", 3)
    w.step({"a": 3})
    for _ in range(5):
        w.step({"a": 1})
    n = len(w.keys["a"])  # 8
    before = w.cap.accum_for(["a"], [n], n)[0]
    keep = torch.zeros(L, HKV, n, dtype=torch.bool)
    keep[:, 0, [0, 2, 5, 7]] = True
    keep[:, 1, [1, 3, 4, 6]] = True
    plan = plan_moves(keep, "holefill")
    w.cap.apply_plan("a", plan, n)
    after = w.cap.accum_for(["a"], [4], 4)[0]
    for h in range(HKV):
        moved = sorted(after[0, h].tolist())
        assert moved == pytest.approx(sorted(before[0, h][keep[0, h]].tolist()))
    # the cache is rebuilt from slot 0 (a preemption's re-prefill): ring and accumulator start over
    w.evicted["a"] = 0
    w.computed["a"] = 0
    w.step({"a": 9})
    ring, sums = w.cap.requests["a"].ring, w.cap.requests["a"].sums
    assert (ring.first, ring.end) == (0, 9) and sums.length == 9
    assert not w.cap.accum_for(["a"], [9], 9).any()
    # finished requests are forgotten
    w.cap.begin_step(["a"])
    assert "a" not in w.cap.requests


def test_re_prefill_rows_are_never_decode_rows():
    """A preempted request re-prefills prompt + its k sampled tokens from slot 0. When vLLM's last chunk of that
    re-prefill is a single row past the prompt, it is still a prefill row (the reference never accumulates
    prefill attention); the next single row is a decode row."""
    w = World(queries=False)
    w.add("a", 3)
    w.step({"a": 3})
    for _ in range(4):
        w.step({"a": 1})
    assert w.requests["a"].num_tokens == 8 and w.cap.decode_rows == 4
    w.computed["a"] = 0                          # preempted: the cache starts over
    w.step({"a": 7})
    w.step({"a": 1})                             # the last re-prefill row, at logical 7 (past the prompt)
    assert w.cap.decode_rows == 4 and not w.cap.accum_for(["a"], [8], 8).any()
    w.step({"a": 1})                             # logical 8: a decode row
    assert w.cap.decode_rows == 5 and w.cap.accum_for(["a"], [9], 9).any()


@pytest.mark.parametrize("capture", ["speculative", "ring_without_spec_slots", "drafts_counted_at_once"])
def test_speculative_rows_count_only_once_accepted(capture, monkeypatch):
    """Speculative decode steps (the sampled token's row plus 3 drafts, a varying number accepted) leave the ring
    and the accumulator as if every accepted token had been a decode step of its own: ring = the last w accepted
    queries, accumulator = the NumPy sum over accepted rows only. Negative controls: a ring without the 3
    speculative slots (a rejected draft overwrites a query the window still reads), and drafts' attention added
    as soon as they run (before the target rejects some)."""
    w = World(spec_tokens=0 if capture == "ring_without_spec_slots" else 3)
    if capture == "drafts_counted_at_once":
        settle = w.cap.decode._settle

        def settle_all(state, cache_len):
            rows, state.pending = state.pending, None
            if rows is not None:
                state.sums.values()[:, :, : rows.shape[3]] += rows.sum(2)
            settle(state, cache_len)

        monkeypatch.setattr(w.cap.decode, "_settle", settle_all)
    w.add("a", 4)
    w.step({"a": 4})
    want = np.zeros((L, HKV, 4))
    for kept in (2, 4, 1, 3, 1, 2):
        start = len(w.keys["a"])
        w.step({"a": 4}, kept={"a": kept})
        want = np.concatenate([want, np.zeros((L, HKV, kept))], axis=-1)
        for i in range(kept):
            want[..., : start + i + 1] += np_step_attention(w.keys["a"][: start + i + 1], w.queries["a"][start + i])
    n = len(w.keys["a"])
    ring_ok = np.array_equal(w.cap.queries_for(["a"], [n])[0].numpy(), np.stack(w.queries["a"][-W:], axis=2))
    accum_ok = np.allclose(w.cap.accum_for(["a"], [n], n)[0].numpy(), want, rtol=1e-5, atol=1e-6)
    assert (ring_ok, accum_ok) == {"speculative": (True, True), "ring_without_spec_slots": (False, True),
                                   "drafts_counted_at_once": (True, False)}[capture]


def test_no_step_no_capture_and_original_forward_always_runs():
    w = World()
    calls = [layer.impl.forward for layer in w.layers]
    assert all(getattr(f, "_kvcompact_capture", None) is w.cap for f in calls)
    # reinstalling wraps the original once, not the wrapper
    w.cap.install(list(enumerate(w.layers)))
    assert w.layers[0].impl.forward._kvcompact_original.__self__ is not None
    w.layers[0].impl.forward(w.layers[0], torch.zeros(3, HQ, D), None, None, w.kv[0], object(), output=None)
    assert w.layers[0].impl.calls == 1 and not w.cap.requests  # no step prepared: nothing captured
