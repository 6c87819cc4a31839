"""GPU round: a compaction round's hot path on a CUDA paged cache at Qwen3-8B-like shapes, no engine.

What a round does on the worker besides vLLM's hooks, on real tensors: gather the keys from the paged cache
(``PagedKV.gather_keys``), TriAttention scores (``TriAttentionPolicy.score``), or both fused into one Triton kernel
that reads the paged cache in place (``paged_triton.triattention_scores``), the keep set (``RoundCore.select``),
the move plans (``RoundCore.plan``) and the moves (``PagedKV.execute``: one Triton launch over all layers, with
the per-layer torch gather/scatter ``move_layers`` timed beside it). The shapes: 36 layers, 32 query / 8 KV heads,
head_dim 128, block 16, bf16, FLASH_ATTN's cache layout [2, num_blocks, block_size, H_kv, d]; the cache of every
request holds budget + 128 tokens (a round's trigger), the TriAttention statistics are random (timings and
keep-set equality do not depend on them).

First the correctness checks, on both FLASH_ATTN's and FLASHINFER's layouts, repack and holefill, both selection
modes: keep sets equal to the CPU path's on the same cache (slots whose selection key lies within float32
rounding of the row's cut count as ties), fused scores against the policy's, and the moved cache bit for bit
against the CPU planner's plans executed on the CPU. Then the timings (medians of CUDA-synchronized repetitions).

The two ratios that say whether a round is fast enough:
(a) round time / (128 x one decode step), the step estimated from memory traffic: the weights a Qwen3-8B step
    reads (every linear layer and the LM head, bf16) plus the KV it reads (requests x (budget + 64) tokens, the mean
    cache between rounds) at the measured device-to-device copy rate (bytes read + written per second). Goal <= 1%.
(b) bytes the moves copy per second / bytes a large device-to-device copy copies per second. Goal >= 50%.

Needs CUDA for the numbers; with ``TRITON_INTERPRET=1`` and ``--quick`` it also runs on a CPU (small shapes,
the kernels in Triton's interpreter), which checks the script, not the speed.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from kvcompact.config import MOVE_MODES, SELECTIONS, KVCompactConfig
from kvcompact.policies.base import ScoreInput
from kvcompact.policies.triattention import TriAttentionPolicy
from kvcompact.rope import RopeSpec
from kvcompact.round import RoundBatch, RoundCore
from kvcompact.selection import _group_max, _protected, _zscore
from kvcompact.stats import ModelFingerprint, QueryStats
from kvcompact.tools.bench import FIXED_ROUNDS
from kvcompact.vllm.kv_layout import FlashLayout, KVLayout, PagedNB2Layout, move_layers, plan_slots
from kvcompact.vllm.paged_kv import PagedKV

# Qwen3-8B: hidden 4096, MLP 12288, 36 layers, 32 x 128 query and 8 x 128 KV projections, vocabulary 151,936.
QWEN3_8B = {"layers": 36, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "hidden": 4096, "mlp": 12288,
            "vocab": 151936}
DIVIDE = 128


def add_arguments(p: Any) -> None:
    p.add_argument("--requests", default=None, help="requests per round, comma list (default 1,8,64)")
    p.add_argument("--budgets", default=None, help="comma list (default 2048,4096)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per phase (default 7)")
    p.add_argument("--torch-path-gb", type=float, default=12.0,
                   help="time the gather + torch scoring path only where its float32 keys fit in this many GB")


def run(ctx: Any) -> dict[str, Any]:
    quick = ctx.quick
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = dict(QWEN3_8B, layers=2 if quick else 36)
    requests = _ints(ctx.args.requests, "1,2" if quick else "1,8,64")
    budgets = _ints(ctx.args.budgets, "64" if quick else "2048,4096")
    reps = ctx.args.reps or (2 if quick else 7)
    env = _environment(device)
    ctx.log("device:", env)
    setup = {"shape": shape, "block_size": 16, "dtype": "bfloat16", "divide_length": DIVIDE,
             "requests": requests, "budgets": budgets, "reps": reps, "layout_timed": "flash [2, nb, bs, H, d]"}
    checks = _correctness(shape, device, budget=64 if quick else 2048, divide=32 if quick else DIVIDE, ctx=ctx)
    failed = [c for c in checks if not c["ok"]]
    if failed:
        ctx.exit_code = 1
    copy = _copy_bandwidth(device, quick)
    ctx.log(f"device-to-device copy: {copy['copy_GBps']:.0f} GB/s copied ({copy['traffic_GBps']:.0f} GB/s r+w)")
    rows = []
    for budget in budgets:
        for B in requests:
            done = _time_shape(shape, device, budget, B, reps, copy, ctx.args.torch_path_gb, quick)
            ctx.log(_row_text(done))
            rows.extend(done)
            _free(device)
            ctx.checkpoint({"checks": checks, "rows": rows})
    headline = {f"b{r['budget']}_r{r['requests']}_{r['mode']}": {
        "round_ms": round(r["round_ms"], 3), "ratio_a_pct": round(100 * r["ratio_a"], 3),
        "ratio_b_pct": round(100 * r["ratio_b"], 1)} for r in rows}
    headline["checks_passed"] = f"{len(checks) - len(failed)}/{len(checks)}"
    result = {"setup": setup, "environment": env, "copy": copy, "checks": checks, "rows": rows,
              "headline": headline}
    _plot(ctx, rows)
    return result


# ---------------------------------------------------------------------------------------------- inputs
def _ints(text: str | None, default: str) -> list[int]:
    return [int(x) for x in (text or default).split(",") if x.strip()]


def _environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "device": str(device)}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(name=p.name, sms=p.multi_processor_count, memory_GiB=round(p.total_memory / 2**30, 1),
                   cuda=torch.version.cuda)
    return env


def _policy(shape: dict[str, int], seed: int = 0) -> TriAttentionPolicy:
    """TriAttention with random query statistics for the shape (neox RoPE, theta 1e6 as Qwen3)."""
    L, Hq, Hkv, d = shape["layers"], shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    g = torch.Generator().manual_seed(seed)
    qbar = torch.complex(torch.randn(L, Hq, d // 2, generator=g), torch.randn(L, Hq, d // 2, generator=g))
    m = qbar.abs() + torch.rand(L, Hq, d // 2, generator=g)
    fp = ModelFingerprint(num_layers=L, num_attention_heads=Hq, num_kv_heads=Hkv, head_dim=d)
    return TriAttentionPolicy(KVCompactConfig(policy="triattention"), QueryStats(qbar, m, fp),
                              RopeSpec.default(d, 1e6))


class _Batch:
    """B requests' paged caches (one tensor per layer, blocks shuffled) and their round inputs on ``device``."""

    def __init__(self, layout: KVLayout, shape: dict[str, int], lengths: list[int], kept_len: list[int],
                 device: torch.device, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        bs, L, H = layout.block_size, shape["layers"], layout.num_kv_heads
        need = [math.ceil(n / bs) for n in lengths]
        num_blocks = sum(need) + 1
        perm = torch.randperm(num_blocks, generator=g)[: sum(need)].to(device)
        self.tables = list(perm.split(need))
        self.caches = [torch.empty(layout.shape(num_blocks), dtype=torch.bfloat16, device=device) for _ in range(L)]
        dg = torch.Generator(device=device).manual_seed(seed)
        for c in self.caches:
            c.normal_(generator=dg)
        self.kv = PagedKV(SimpleNamespace(kv_caches=self.caches), layout, lambda _layer, k: k.float())
        self.lengths = lengths
        B, N = len(lengths), max(lengths)
        offset = torch.randint(0, 4 * N, (B,), generator=g)  # tokens evicted in earlier rounds
        slot = torch.arange(N)
        positions = torch.where(slot < torch.tensor(lengths)[:, None], slot + offset[:, None], -1)
        self.positions = positions[:, None, None, :].expand(B, L, H, N).contiguous().to(device)
        self.t = (offset + torch.tensor(lengths)).to(device)
        self.kept_len = torch.tensor(kept_len, device=device)
        self.prompt_len = torch.full((B,), 64, device=device)

    def round_input(self, keys: torch.Tensor) -> RoundBatch:
        return RoundBatch(keys=keys, positions=self.positions, logical_len=self.t, kept_len=self.kept_len,
                          prompt_len=self.prompt_len, cache_lens=self.lengths)

    def to(self, device: torch.device) -> _Batch:
        other = object.__new__(_Batch)
        other.__dict__.update(self.__dict__)
        other.tables = [t.to(device, copy=True) for t in self.tables]
        other.caches = [c.to(device, copy=True) for c in self.caches]
        other.kv = PagedKV(SimpleNamespace(kv_caches=other.caches), self.kv.layout, self.kv.key_reader)
        for name in ("positions", "t", "kept_len", "prompt_len"):
            setattr(other, name, getattr(self, name).to(device))
        return other


def _core(shape: dict[str, int], policy: TriAttentionPolicy, budget: int, mode: str, selection: str) -> RoundCore:
    cfg = KVCompactConfig(policy="triattention", budget=budget, divide_length=DIVIDE, compaction=mode,
                          selection=selection, **FIXED_ROUNDS)
    return RoundCore(cfg, policy, shape["q_heads"])


# ---------------------------------------------------------------------------------------------- correctness
def _selection_key(core: RoundCore, scores: torch.Tensor, b: _Batch) -> torch.Tensor:
    """The key select_keep ranks slots by ([B, L, H, N], per_head's layer mean repeated over layers), recomputed
    here to tell ties from errors."""
    cfg = core.config
    valid = b.positions >= 0
    protected = _protected(b.positions, valid, b.t, b.prompt_len, cfg.window, cfg.protect_prompt, cfg.n_sink)
    H = b.positions.shape[2]
    cand = (valid & ~protected).repeat_interleave(scores.shape[2] // H, dim=2)
    agg = _group_max(_zscore(scores.float(), cand), H)
    if cfg.selection == "per_head":
        agg = agg.mean(dim=1, keepdim=True).expand_as(agg)
    return torch.where(protected, torch.inf, agg).masked_fill(~valid, -torch.inf)


def _keep_mismatch(keep: torch.Tensor, ref: torch.Tensor, key: torch.Tensor, tol: float = 1e-4) -> dict[str, Any]:
    """Slots kept by one path only, and how many of them are not ties: a tie is a slot whose selection key (from
    the reference scores) lies within ``tol`` of its row's cut (the smallest key the reference kept)."""
    keep, ref, key = keep.cpu(), ref.cpu(), key.cpu()
    differ = keep != ref
    cut = key.masked_fill(~ref, torch.inf).amin(dim=-1, keepdim=True)
    ties = differ & ((key - cut).abs() <= tol * cut.abs().clamp_min(1.0))
    return {"slots_differing": int(differ.sum()), "not_ties": int((differ & ~ties).sum()),
            "counts_equal": bool(torch.equal(keep.sum(-1), ref.sum(-1)))}


def _correctness(shape: dict[str, int], device: torch.device, *, budget: int, divide: int,
                 ctx: Any) -> list[dict[str, Any]]:
    from kvcompact.vllm import paged_triton

    policy = _policy(shape)
    N = budget + divide
    lengths, kept_len = [N, N - 40, N - 3 * divide // 2], [budget, budget, budget - divide]
    checks: list[dict[str, Any]] = []

    def check(name: str, ok: bool, **info: Any) -> None:
        checks.append({"check": name, "ok": bool(ok), **info})
        ctx.log(("PASS " if ok else "FAIL ") + name, info or "")

    for li, cls in enumerate((FlashLayout, PagedNB2Layout)):
        layout = cls(16, shape["kv_heads"], shape["head_dim"])
        gpu = _Batch(layout, shape, lengths, kept_len, device, seed=10 + li)
        cpu = gpu.to(torch.device("cpu"))
        keys_cpu = cpu.kv.gather_keys(cpu.tables, lengths)
        keys_gpu = gpu.kv.gather_keys(gpu.tables, lengths)
        check(f"{layout.name}: gathered keys equal", torch.equal(keys_gpu.cpu(), keys_cpu))
        x = ScoreInput(keys=keys_gpu, positions=gpu.positions, logical_len=gpu.t, num_q_heads=shape["q_heads"])
        s_gpu = policy.score(x)
        s_cpu = policy.score(ScoreInput(keys=keys_cpu, positions=cpu.positions, logical_len=cpu.t,
                                        num_q_heads=shape["q_heads"]))
        s_fused = paged_triton.triattention_scores(policy, layout, gpu.caches, gpu.tables, lengths, gpu.t,
                                                   shape["q_heads"])
        rel = lambda a, r: float((a.cpu().double() - r.double()).norm() / r.double().norm())  # noqa: E731
        check(f"{layout.name}: torch scores on {device.type} vs cpu", rel(s_gpu, s_cpu) < 1e-5,
              rel_err=rel(s_gpu, s_cpu))
        check(f"{layout.name}: fused scores vs cpu", rel(s_fused, s_cpu) < 1e-5, rel_err=rel(s_fused, s_cpu))
        for selection in SELECTIONS:
            core_cpu = _core(shape, policy, budget, "repack", selection)
            keep_cpu = core_cpu.select(s_cpu, cpu.positions, cpu.t, cpu.kept_len, cpu.prompt_len)
            key = _selection_key(core_cpu, s_cpu, cpu)
            for path, scores in (("torch", s_gpu), ("fused", s_fused)):
                keep = core_cpu.select(scores, gpu.positions, gpu.t, gpu.kept_len, gpu.prompt_len)
                mm = _keep_mismatch(keep, keep_cpu, key)
                check(f"{layout.name} {selection}: {path} keep set vs cpu", mm["not_ties"] == 0 and mm["counts_equal"],
                      **mm)
            for mode in MOVE_MODES:
                core = _core(shape, policy, budget, mode, selection)
                plans_cpu = core.plan(keep_cpu, lengths)
                plans_gpu = core.plan(keep_cpu.to(device), lengths)
                same_plans = all(torch.equal(p.src.cpu(), q.src) and torch.equal(p.dst.cpu(), q.dst)
                                 and torch.equal(p.valid.cpu(), q.valid) for p, q in zip(plans_gpu, plans_cpu))
                check(f"{layout.name} {selection} {mode}: plans on {device.type} equal cpu's", same_plans)
                moved_cpu = cpu.to(torch.device("cpu"))
                moved_cpu.kv.execute(moved_cpu.tables, plans_cpu)
                for path, fn in (("execute", None), ("move_layers", move_layers)):
                    moved = gpu.to(device)
                    on_dev = [_plan_to(p, device) for p in plans_cpu]
                    if fn is None:
                        moved.kv.execute(moved.tables, on_dev)
                    else:
                        _execute_with(moved, on_dev, fn)
                    bitwise = all(torch.equal(a.cpu().view(torch.int16), b.view(torch.int16))
                                  for a, b in zip(moved.caches, moved_cpu.caches))
                    changed = sum(not torch.equal(a, b) for a, b in zip(moved_cpu.caches, cpu.caches))
                    check(f"{layout.name} {selection} {mode}: {path} cache bit-equal to cpu planner's result",
                          bitwise and changed > 0, layers_changed=changed)
                del moved_cpu
        del gpu, cpu, keys_cpu, keys_gpu
        _free(device)
    return checks


def _plan_to(plan: Any, device: torch.device) -> Any:
    return type(plan)(src=plan.src.to(device), dst=plan.dst.to(device), valid=plan.valid.to(device),
                      kept_len=plan.kept_len)


def _execute_with(b: _Batch, plans: list[Any], fn: Callable[..., None]) -> None:
    """PagedKV.execute's slot mapping with another mover (the per-layer torch gather/scatter)."""
    fn(b.kv.layout, b.caches, *plan_slots(b.tables, plans, b.kv.layout.block_size))


# ---------------------------------------------------------------------------------------------- timings
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _timed(fn: Callable[[], Any], device: torch.device, reps: int) -> tuple[float, Any]:
    """(median ms over ``reps`` runs after one warm-up, the last result)."""
    out = fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    times.sort()
    return times[len(times) // 2], out


def _copy_bandwidth(device: torch.device, quick: bool) -> dict[str, float]:
    n = (64 if quick else 2048) * 2**20  # bytes per buffer
    x = torch.empty(n // 2, dtype=torch.bfloat16, device=device).normal_()
    y = torch.empty_like(x)
    ms, _ = _timed(lambda: y.copy_(x), device, 10)
    return {"buffer_MiB": n / 2**20, "copy_ms": ms, "copy_GBps": n / ms / 1e6, "traffic_GBps": 2 * n / ms / 1e6}


def _decode_step_ms(shape: dict[str, int], B: int, budget: int, traffic_GBps: float) -> tuple[float, dict]:
    """Bytes one decode step must read (bf16 weights of every linear layer and the LM head, and the KV of B
    requests at the mean cache length between rounds) over the measured memory rate."""
    L, hid, mlp, d = shape["layers"], shape["hidden"], shape["mlp"], shape["head_dim"]
    per_layer = hid * shape["q_heads"] * d * 2 + hid * shape["kv_heads"] * d * 2 + 3 * hid * mlp
    weights = 2 * (L * per_layer + shape["vocab"] * hid)
    kv = B * (budget + DIVIDE // 2) * L * shape["kv_heads"] * d * 2 * 2
    return (weights + kv) / traffic_GBps / 1e6, {"weight_bytes": weights, "kv_bytes": kv}


def _time_shape(shape: dict[str, int], device: torch.device, budget: int, B: int, reps: int,
                copy: dict[str, float], torch_path_gb: float, quick: bool) -> list[dict[str, Any]]:
    from kvcompact.vllm import paged_triton

    policy = _policy(shape)
    N = budget + (32 if quick else DIVIDE)
    layout = FlashLayout(16, shape["kv_heads"], shape["head_dim"])
    b = _Batch(layout, shape, [N] * B, [budget] * B, device, seed=B)
    L, H, d = shape["layers"], layout.num_kv_heads, layout.head_dim
    row: dict[str, Any] = {"budget": budget, "requests": B, "cache_tokens": N}
    fused_ms, scores = _timed(lambda: paged_triton.triattention_scores(
        policy, layout, b.caches, b.tables, b.lengths, b.t, shape["q_heads"]), device, reps)
    row["score_fused_ms"] = fused_ms
    keys_gb = B * L * H * N * d * 4 / 1e9
    if keys_gb <= torch_path_gb:
        row["gather_ms"], keys = _timed(lambda: b.kv.gather_keys(b.tables, b.lengths), device, reps)
        x = ScoreInput(keys=keys, positions=b.positions, logical_len=b.t, num_q_heads=shape["q_heads"])
        row["score_torch_ms"], _ = _timed(lambda: policy.score(x), device, reps)
    else:
        row["torch_path_skipped"] = f"float32 keys would take {keys_gb:.1f} GB"
    core = _core(shape, policy, budget, "repack", "per_head")
    row["select_ms"], keep = _timed(lambda: core.select(scores, b.positions, b.t, b.kept_len, b.prompt_len),
                                    device, reps)
    step_ms, step_bytes = _decode_step_ms(shape, B, budget, copy["traffic_GBps"])
    row.update(decode_step_ms_est=step_ms, **step_bytes)
    rows = []
    for mode in MOVE_MODES:
        core = _core(shape, policy, budget, mode, "per_head")
        r = dict(row, mode=mode)
        r["plan_ms"], plans = _timed(lambda: core.plan(keep, b.lengths), device, reps)  # noqa: B023
        moves = sum(p.num_moves for p in plans)
        r["moves"] = moves
        r["bytes_moved"] = moves * 2 * d * 2
        r["move_ms"], _ = _timed(lambda: b.kv.execute(b.tables, plans), device, reps)  # noqa: B023
        r["move_torch_ms"], _ = _timed(lambda: _execute_with(b, plans, move_layers), device, reps)  # noqa: B023
        r["round_ms"] = r["score_fused_ms"] + r["select_ms"] + r["plan_ms"] + r["move_ms"]

        def whole() -> None:
            scores = paged_triton.triattention_scores(policy, layout, b.caches, b.tables, b.lengths, b.t,
                                                      shape["q_heads"])
            kp = core.select(scores, b.positions, b.t, b.kept_len, b.prompt_len)  # noqa: B023
            b.kv.execute(b.tables, core.plan(kp, b.lengths))  # noqa: B023

        r["round_whole_ms"], _ = _timed(whole, device, max(3, reps // 2))
        r["ratio_a"] = r["round_whole_ms"] / (DIVIDE * step_ms)
        r["move_GBps"] = r["bytes_moved"] / r["move_ms"] / 1e6
        r["ratio_b"] = r["move_GBps"] / copy["copy_GBps"]
        rows.append(r)
    return rows


def _row_text(rows: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"budget {r['budget']} x{r['requests']:>3} {r['mode']:8s} fused score {r['score_fused_ms']:8.3f} "
        f"gather {r.get('gather_ms', float('nan')):8.3f} torch score {r.get('score_torch_ms', float('nan')):8.3f} "
        f"select {r['select_ms']:7.3f} plan {r['plan_ms']:7.3f} move {r['move_ms']:7.3f} "
        f"(torch {r['move_torch_ms']:7.3f}) round {r['round_whole_ms']:8.3f} ms | step~{r['decode_step_ms_est']:.2f} ms"
        f" a={100 * r['ratio_a']:.3f}% b={100 * r['ratio_b']:.1f}%" for r in rows)


def _plot(ctx: Any, flat: list[dict[str, Any]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        ctx.notes.append("matplotlib missing: no plot")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    phases = ("score_fused_ms", "select_ms", "plan_ms", "move_ms")
    labels = [f"{r['budget']}\nx{r['requests']}\n{r['mode'][:4]}" for r in flat]
    bottom = [0.0] * len(flat)
    for ph in phases:
        vals = [r[ph] for r in flat]
        ax1.bar(range(len(flat)), vals, bottom=bottom, label=ph.replace("_ms", ""))
        bottom = [a + v for a, v in zip(bottom, vals)]
    ax1.set_xticks(range(len(flat)), labels, fontsize=7)
    ax1.set_ylabel("ms per round (medians)")
    ax1.set_title("round phases (budget / requests / move mode)")
    ax1.legend(fontsize=8)
    ax2.bar([i - 0.2 for i in range(len(flat))], [100 * r["ratio_a"] for r in flat], 0.4,
            label="(a) round / 128 decode steps, %")
    ax2.bar([i + 0.2 for i in range(len(flat))], [100 * r["ratio_b"] for r in flat], 0.4,
            label="(b) move GB/s / copy GB/s, %")
    ax2.axhline(1, color="C0", ls=":", lw=1)
    ax2.axhline(50, color="C1", ls=":", lw=1)
    ax2.set_yscale("log")
    ax2.set_xticks(range(len(flat)), labels, fontsize=7)
    ax2.set_title("goals: (a) <= 1%, (b) >= 50%")
    ax2.legend(fontsize=8)
    ctx.savefig(fig)
