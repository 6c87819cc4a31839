"""transformers' attention, intercepted: the model's own eager attention runs as before, and a sink sees every
layer's post-RoPE query first and returns the mask the layer runs with. The transformers reference
(:mod:`kvcompact.reference`) records the query windows and attention SnapKV, R-KV and H2O score with through it,
and gives sliding-window layers a mask from the cache's position tags.

The interception is registered as its own attention implementation (transformers' ``AttentionInterface``) and
switched on ``model.config`` for the duration of :func:`intercept`; the active sink is a stack, so nested uses
see the innermost one.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from torch import Tensor

_IMPL = "kvcompact_capture"
_SINK: list[Callable[[int, Tensor, Tensor | None, int | None], Tensor | None]] = []


def _capture_attention(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                       **kwargs: Any) -> tuple[Tensor, Tensor]:
    """The model's own eager attention, reporting the post-RoPE query of every layer to the active sink, which
    returns the mask to run with (a sliding-window layer's comes from the position tags)."""
    if _SINK:
        attention_mask = _SINK[-1](int(module.layer_idx), query, attention_mask, kwargs.get("sliding_window"))
    return _eager_of(module)(module, query, key, value, attention_mask, **kwargs)


def _eager_of(module: Any) -> Callable[..., tuple[Tensor, Tensor]]:
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward

        return eager_attention_forward
    return fn


@contextlib.contextmanager
def intercept(model: Any, sink: Callable[[int, Tensor, Tensor | None, int | None], Tensor | None]) -> Iterator[None]:
    """Route the model's attention through :func:`_capture_attention` (registered under its own name, with the
    eager mask) for the duration of the block. The swap is on ``model.config``, so do not run the same model
    object from another thread meanwhile."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(_IMPL, _capture_attention)
    AttentionMaskInterface.register(_IMPL, eager_mask)
    previous = model.config._attn_implementation
    if previous != "eager":
        raise ValueError(f"the kvcompact reference needs attn_implementation='eager', the model uses {previous!r}"
                         " (load it with kvcompact.reference.load_model)")
    model.config._attn_implementation = _IMPL
    _SINK.append(sink)
    try:
        yield
    finally:
        _SINK.pop()
        model.config._attn_implementation = previous


__all__ = ["intercept"]
