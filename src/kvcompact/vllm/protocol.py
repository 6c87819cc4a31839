"""What crosses the scheduler/worker boundary, attached to vLLM's own step messages.

The scheduler attaches a :class:`StepMessage` to ``SchedulerOutput`` (it reaches every worker, also under
tensor/pipeline parallelism), and workers attach a :class:`WorkerReport` to ``ModelRunnerOutput`` (it comes back
to ``Scheduler.update_from_output``). Both are plain picklable dataclasses.

The scheduler decides *how many* tokens a request keeps and which blocks it frees; a worker only decides
*which* tokens survive in its own KV heads and layers. So every worker frees the same blocks and no worker can
diverge in cache length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at run time: the metrics and the tools import this module without torch
    from kvcompact.round import Round

MESSAGE_ATTR = "kvcompact_message"
REPORT_ATTR = "kvcompact_report"


@dataclass
class StepMessage:
    """Per step: rounds to run before the forward pass, and every compressed request's eviction offset
    (``logical length - cache length``) from its ledger (:class:`kvcompact.ledger.Ledger`), the only copy a
    worker reads for the slot mapping and ``seq_lens``."""

    rounds: list[Round] = field(default_factory=list)
    evicted: dict[str, int] = field(default_factory=dict)


@dataclass
class WorkerReport:
    """Measured by the worker that ran the rounds (the scheduler already knows tokens and blocks)."""

    rounds: int = 0
    tokens_moved: int = 0
    bytes_moved: int = 0
    compaction_seconds: list[float] = field(default_factory=list)
    scoring_seconds: list[float] = field(default_factory=list)
    scoring_fallbacks: dict[str, str] = field(default_factory=dict)  # scoring failed: kept the most recent tokens
    aborted: dict[str, str] = field(default_factory=dict)  # compaction failed: the request must end in an error
    recalled_tokens: int = 0      # tokens the recall tier swapped back in, summed over layers and KV heads
    recall_seconds: float = 0.0   # the recall tier's time on this worker (decisions and swaps)
    store_bytes: int | None = None  # the recall stores' bytes on this worker now (None: unchanged)
    store_dropped: int = 0        # stored tokens dropped for good past recall_tokens, over layers and KV heads
