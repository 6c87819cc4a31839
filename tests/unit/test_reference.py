"""The transformers reference path (kvcompact.reference) on the bundled SmolLM2 model in fp32 with a short prompt.

Independent oracles: transformers' own ``model.generate`` (no round), the PoC's drop-and-continue loop with logical
RoPE positions (streaming rounds), a full forward (NLL), and ``output_attentions`` of a plain forward (the H2O
accumulator / query capture). Negative controls show each check can fail.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvcompact import reference  # noqa: E402
from kvcompact.config import KVCompactConfig  # noqa: E402
from support import FIXED
from support.mutants import generate_rope_at_slot_index

PROMPT = ("Alice was beginning to get very tired of sitting by her sister on the bank, "
          "and of having nothing to do")
NEW = 20
# Streaming with sinks 4 + recent 8 = budget 12, a round every 6 tokens: with the 22-token prompt the first round
# falls inside the prompt (before feeding logical 18), the others before the decode steps at logical 24, 30, 36.
SINK, BUDGET, EVERY, WINDOW = 4, 12, 6, 4


def streaming(**kw) -> KVCompactConfig:
    base = dict(FIXED, policy="streaming", budget=BUDGET, divide_length=EVERY, window=WINDOW, n_sink=SINK)
    base.update(kw)
    return KVCompactConfig(**base)


@pytest.fixture(scope="module")
def model(reference_model):
    return reference_model  # conftest's: the bundled model, fp32, eager attention


@pytest.fixture(scope="module")
def prompt(model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model.config._name_or_path)
    ids = tok(PROMPT)["input_ids"]
    assert len(ids) == 22
    return ids


@pytest.fixture(scope="module")
def full(model, prompt):
    return reference.generate(model, prompt, NEW, None)[0]


def naive_drop_and_continue(model, prompt, n, *, sink, recent, every, pos_shift=0):
    """The PoC's run_hf, one token per forward from the first prompt token on: whenever the cache holds
    sink + recent + every tokens (inside the prompt too), keep its first ``sink`` and last ``recent`` slots (same
    tokens in every head and layer), then continue at logical RoPE positions (``pos_shift`` is added to the
    generated tokens' positions: a deliberate bug for the negative control)."""
    pkv, toks, cache_len = None, [], 0
    with torch.no_grad():
        for logical in range(len(prompt) + n - 1):
            if cache_len >= sink + recent + every:
                keep = torch.cat([torch.arange(sink), torch.arange(cache_len - recent, cache_len)])
                for layer in pkv.layers:
                    layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
                cache_len = len(keep)
            generated = logical >= len(prompt)
            token = toks[-1] if generated else prompt[logical]
            out = model(input_ids=torch.tensor([[token]]), past_key_values=pkv, use_cache=True,
                        position_ids=torch.tensor([[logical + (pos_shift if generated else 0)]]))
            pkv = out.past_key_values
            cache_len += 1
            if logical >= len(prompt) - 1:
                toks.append(int(out.logits[0, -1].argmax()))
    return toks


def test_no_round_equals_model_generate(model, prompt, full):
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)[0, len(prompt):].tolist()
    assert ref == full
    big = KVCompactConfig(**FIXED, policy="knorm", budget=512, divide_length=16, window=8)
    toks, rounds = reference.generate(model, prompt, NEW, big)
    assert rounds == [] and toks == full
    # eviction=False is full attention whatever the budget (this config would evict right after the prompt)
    assert reference.generate(model, prompt, 6, streaming(), eviction=False) == (full[:6], [])
    # negative control: the same loop with the decode RoPE positions off by one does not match
    assert naive_drop_and_continue(model, prompt, NEW, sink=SINK, recent=10**6, every=0) == full
    assert naive_drop_and_continue(model, prompt, NEW, sink=SINK, recent=10**6, every=0, pos_shift=1) != full


@pytest.fixture(scope="module")
def naive_streaming(model, prompt):
    return naive_drop_and_continue(model, prompt, NEW, sink=SINK, recent=BUDGET - SINK, every=EVERY)


@pytest.mark.parametrize("compaction,selection", [("repack", "per_head"), ("holefill", "per_layer_per_head")])
def test_streaming_rounds_equal_naive(model, prompt, full, naive_streaming, compaction, selection):
    cfg = streaming(compaction=compaction, selection=selection)
    toks, rounds = reference.generate(model, prompt, NEW, cfg)
    assert [(r.logical_len, r.cache_len, r.kept_len) for r in rounds] == [
        (18, 18, 12), (24, 18, 12), (30, 18, 12), (36, 18, 12)]
    assert toks == naive_streaming
    assert toks != full                      # eviction mattered
    L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
    for r in rounds:
        assert r.keep_mask.shape == (L, H, r.cache_len) and r.keep_mask.dtype == torch.bool
        assert (r.keep_mask.sum(-1) == BUDGET).all()
    # Repack keeps slot order = position order, so the keep mask is sinks + the most recent slots.
    if compaction != "holefill":
        want = torch.zeros(18, dtype=torch.bool)
        want[:SINK] = want[-(BUDGET - SINK):] = True
        assert all(torch.equal(r.keep_mask, want.expand(L, H, 18)) for r in rounds)


def test_compaction_none_is_full_attention_as_in_the_engine(model, prompt, full):
    """The engine moves nothing under compaction "none" (every token stays attended), so neither does the
    reference: the same tokens as full attention, no rounds."""
    assert reference.generate(model, prompt, NEW, streaming(compaction="none")) == (full, [])


def test_rope_at_slot_index_is_caught(model, prompt, naive_streaming):
    toks, rounds = generate_rope_at_slot_index(model, prompt, NEW, streaming())
    assert len(rounds) == 4
    assert toks != naive_streaming


def _drive(model, prompt, cfg, tokens):
    """Teacher-force ``tokens`` through the private _Run (to look at the cache and position tags)."""
    run = reference._Run(model, cfg, stats=None, keep_sets=None, eviction=True, prompt_len=len(prompt))
    with torch.no_grad(), run.capturing():
        run.forward(prompt, prefill=True, logits_to_keep=1)
        for tok in tokens:
            run.maybe_round()
            run.forward([tok], prefill=False, logits_to_keep=1)
    return run


def test_holefill_holds_the_same_tokens_as_repack_permuted(model, prompt, full):
    """Per layer and KV head, a hole-filled cache is the repacked one permuted by the position tags, and the
    tags are the RoPE phases of the keys: slot order differs, content does not."""
    cfg = KVCompactConfig(**FIXED, policy="knorm", budget=16, divide_length=5, window=4, selection="per_layer_per_head")
    rep = _drive(model, prompt, cfg, full[:12])
    hol = _drive(model, prompt, cfg.replace(compaction="holefill"), full[:12])
    assert len(rep.rounds) == len(hol.rounds) == 3
    assert not torch.equal(hol.positions, rep.positions)          # hole-filling really reordered slots
    order = hol.positions.argsort(dim=-1)
    assert torch.equal(hol.positions.gather(-1, order), rep.positions)
    for which in ("keys", "values"):
        h = hol.kv.stacked(which)
        h = h.gather(2, order.unsqueeze(-1).expand_as(h))
        torch.testing.assert_close(h, rep.kv.stacked(which), rtol=1e-4, atol=1e-5)
    # per_layer_per_head: layers chose different tokens
    assert any(not torch.equal(r.keep_mask[0], r.keep_mask[l])
               for r in rep.rounds for l in range(1, r.keep_mask.shape[0]))


def test_replay_keep_sets(model, prompt):
    cfg = KVCompactConfig(**FIXED, policy="knorm", budget=12, divide_length=6, window=4, selection="per_layer_per_head",
                          compaction="holefill")
    toks, rounds = reference.generate(model, prompt, NEW, cfg)
    assert len(rounds) == 4
    keep_sets = [r.keep_mask for r in rounds]
    again, rounds2 = reference.generate(model, prompt, NEW, cfg, keep_sets=keep_sets)
    assert again == toks
    assert all(torch.equal(a.keep_mask, b.keep_mask) for a, b in zip(rounds, rounds2))
    # negative control: the first round keeps the most recent slots instead of the recorded ones
    corrupt = [k.clone() for k in keep_sets]
    corrupt[0][:] = False
    corrupt[0][..., -12:] = True
    assert not torch.equal(corrupt[0], keep_sets[0])
    assert reference.generate(model, prompt, NEW, cfg, keep_sets=corrupt)[0] != toks
    with pytest.raises(ValueError, match="keep sets"):
        reference.generate(model, prompt, NEW, cfg, keep_sets=keep_sets[:2])


def test_triattention_rounds(model, prompt):
    from kvcompact.tools.calibrate import calibrate_model

    stats = calibrate_model(model, [prompt], progress=False)
    cfg = KVCompactConfig(**FIXED, policy="triattention", budget=12, divide_length=6, window=4)
    toks, rounds = reference.generate(model, prompt, 14, cfg, stats=stats)
    assert [r.logical_len for r in rounds] == [18, 24, 30]  # the first inside the 22-token prompt
    for r in rounds:   # per_head: one mask for every layer; the recent window is always kept
        assert torch.equal(r.keep_mask, r.keep_mask[:1].expand_as(r.keep_mask)) and r.keep_mask[..., -WINDOW:].all()
    assert reference.generate(model, prompt, 14, cfg, keep_sets=[r.keep_mask for r in rounds])[0] == toks


def test_teacher_forced_nll(model, prompt, full, monkeypatch):
    ids = prompt + full
    prefix = 10
    nll_full = reference.teacher_forced_nll(model, ids, None, prefix_len=prefix)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, prefix - 1:-1]
    ref = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[prefix:]), reduction="none")
    assert nll_full.shape == (len(ids) - prefix,)
    torch.testing.assert_close(nll_full, ref, rtol=1e-4, atol=1e-4)

    cfg = streaming(budget=16, divide_length=6)
    chunked = reference.teacher_forced_nll(model, ids, cfg, prefix_len=prefix)
    monkeypatch.setattr(reference, "_MAX_CHUNK", 1)     # strictly one token per forward
    stepwise = reference.teacher_forced_nll(model, ids, cfg, prefix_len=prefix)
    torch.testing.assert_close(chunked, stepwise, rtol=1e-4, atol=1e-4)
    # the first round runs before feeding the token at logical 22 (cache 16 + 6): the NLL of ids[23] onward moves
    first = 22 - prefix + 1
    torch.testing.assert_close(chunked[:first], nll_full[:first], rtol=1e-4, atol=1e-4)
    assert (chunked[first:] - nll_full[first:]).abs().max() > 1e-2


def streaming_mask(n: int, prefix: int, budget: int, every: int, sink: int, shift: int = 0) -> torch.Tensor:
    """The attention a streaming-compressed cache allows, as a 4-D additive mask over the full sequence: the
    query fed at logical i sees every earlier key until the first round, then the sinks and the ``budget - sink``
    keys before the latest round R (rounds run before feeding logical budget + every + k * every) up to i.
    ``shift`` moves the recent range's start: a deliberately wrong mask for the negative control."""
    mask = torch.zeros(n, n)
    first = budget + every
    for i in range(n):
        rounds = list(range(first, i + 1, every))  # inside the prefill too: its chunks end at the trigger
        allowed = torch.zeros(n, dtype=torch.bool)
        if rounds:
            allowed[:sink] = True
            allowed[rounds[-1] - (budget - sink) + shift: i + 1] = True
        else:
            allowed[: i + 1] = True
        mask[i, ~allowed] = float("-inf")
    return mask.view(1, 1, n, n)


@pytest.mark.parametrize("prefix", [40, 400])
def test_teacher_forced_streaming_equals_masked_attention(model, prefix):
    """Independent oracle for what the accuracy harness measures: streaming rounds over a long text, fed in
    chunks of up to 256 tokens between rounds, give the per-token NLL of one full forward whose attention mask
    allows exactly the keys the compressed cache holds (RoPE at true positions, no cache at all). With a
    400-token prefix, four rounds run inside the prefill."""
    from transformers import AutoTokenizer

    from kvcompact.tools.corpus import eval_text

    tok = AutoTokenizer.from_pretrained(model.config._name_or_path)
    ids = tok(eval_text().read_text()[:4000])["input_ids"][:700]
    budget, every = 128, 64
    cfg = KVCompactConfig(**FIXED, policy="streaming", budget=budget, divide_length=every, window=16, n_sink=SINK)
    nll = reference.teacher_forced_nll(model, ids, cfg, prefix_len=prefix)
    x = torch.tensor([ids])

    def masked(shift: int) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=x, attention_mask=streaming_mask(len(ids), prefix, budget, every, SINK, shift)
                           ).logits[0, prefix - 1:-1]
        return torch.nn.functional.cross_entropy(logits, x[0, prefix:], reduction="none")

    torch.testing.assert_close(nll, masked(0), rtol=1e-4, atol=2e-4)
    # negative control: one key fewer in the recent range after every round is visible in the NLL
    assert (nll - masked(1)).abs().max() > 1e-3


def test_query_capture_and_h2o_accumulator(model, prompt, full):
    """With no round, the H2O accumulator equals the attention weights of a plain eager forward (summed over
    the GQA group and the decode steps), which checks the post-RoPE query capture too."""
    cfg = KVCompactConfig(**FIXED, policy="h2o", budget=512, divide_length=16, window=8)
    steps = full[:4]
    run = _drive(model, prompt, cfg, steps)
    assert run.rounds == []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt + steps]), output_attentions=True)
    g = model.config.num_attention_heads // model.config.num_key_value_heads
    want = torch.stack([a[0, :, len(prompt):].sum(1) for a in out.attentions])          # [L, H_q, N]
    want = want.view(want.shape[0], -1, g, want.shape[-1]).sum(2)
    torch.testing.assert_close(run.accum.values(), want, rtol=1e-4, atol=1e-5)
    assert model.config._attn_implementation == "eager"                                 # capture restored


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "rkv", "random"])
def test_other_policies_run_and_replay(model, prompt, policy):
    cfg = KVCompactConfig(**FIXED, policy=policy, budget=12, divide_length=6, window=4, query_window=4)
    toks, rounds = reference.generate(model, prompt, 8, cfg)
    assert [r.logical_len for r in rounds] == [18, 24]
    assert reference.generate(model, prompt, 8, cfg, keep_sets=[r.keep_mask for r in rounds])[0] == toks
