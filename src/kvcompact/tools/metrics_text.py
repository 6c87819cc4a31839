"""A small parser for the Prometheus text exposition format (what vLLM serves on ``/metrics``).

Why our own: ``kvcompact doctor`` must run from an operator's laptop against any server, and a tool that
diagnoses a broken deployment must itself fail clearly: every malformed line raises :class:`MetricsParseError`
with its line number instead of being skipped silently (a silently dropped ``kvcompact:`` line would turn into
a wrong verdict). Histograms need no special case: ``_bucket``/``_sum``/``_count`` are ordinary samples.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_VALUE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|[+-]?Inf|NaN")
_TIMESTAMP = re.compile(r"-?\d+(?:\.\d+)?")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}
_TYPES = {"counter", "gauge", "histogram", "summary", "untyped", "info", "stateset", "gaugehistogram", "unknown"}


class MetricsParseError(ValueError):
    """The text is not valid exposition format; ``line`` is the 1-based line number of the first bad line."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line


@dataclass(frozen=True)
class Sample:
    """One exposition line: ``name{labels} value [timestamp]``."""

    name: str
    labels: dict[str, str]
    value: float
    timestamp: float | None = None


@dataclass
class Metrics:
    """Parsed samples plus the declared ``# TYPE`` of each family, with the aggregations doctor needs.

    vLLM adds ``model_name`` and ``engine`` labels to every metric, so a caller asks for a name and gets the
    aggregate over all label sets rather than guessing one label set.
    """

    samples: list[Sample] = field(default_factory=list)
    types: dict[str, str] = field(default_factory=dict)

    def series(self, name: str) -> list[Sample]:
        return [s for s in self.samples if s.name == name]

    def total(self, name: str) -> float | None:
        """Sum over label sets (counters, request gauges); None when the metric is absent."""
        found = self.series(name)
        return sum(s.value for s in found) if found else None

    def maximum(self, name: str) -> float | None:
        """Max over label sets (a ratio such as usage: the fullest engine is the one that preempts)."""
        found = [s.value for s in self.series(name) if not math.isnan(s.value)]
        return max(found) if found else None

    def has_prefix(self, prefix: str) -> bool:
        return any(s.name.startswith(prefix) for s in self.samples)


def parse_metrics(text: str) -> Metrics:
    """Parse a whole exposition; raise :class:`MetricsParseError` on the first malformed line."""
    metrics = Metrics()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            _parse_comment(line, number, metrics.types)
            continue
        metrics.samples.append(_parse_sample(line, number))
    return metrics


def _parse_comment(line: str, number: int, types: dict[str, str]) -> None:
    parts = line[1:].split(None, 2)
    if not parts or parts[0] not in ("HELP", "TYPE"):
        return  # a free comment (or OpenMetrics "# EOF")
    if len(parts) < 2 or not _NAME.fullmatch(parts[1]):
        raise MetricsParseError(number, f"# {parts[0]} without a valid metric name")
    if parts[0] == "TYPE":
        kind = parts[2].strip() if len(parts) == 3 else ""
        if kind not in _TYPES:
            raise MetricsParseError(number, f"unknown metric type {kind!r} for {parts[1]}")
        types[parts[1]] = kind


def _parse_sample(line: str, number: int) -> Sample:
    match = _NAME.match(line)
    if not match:
        raise MetricsParseError(number, f"expected a metric name, got {line[:40]!r}")
    name, pos = match.group(), match.end()
    labels: dict[str, str] = {}
    if pos < len(line) and line[pos] == "{":
        labels, pos = _parse_labels(line, pos + 1, number)
    rest = line[pos:]
    if rest and not rest[0].isspace():
        raise MetricsParseError(number, f"unexpected {rest[0]!r} after {name}")
    fields = rest.split()
    if len(fields) not in (1, 2):
        raise MetricsParseError(number, f"{name}: expected 'value [timestamp]', got {rest.strip()!r}")
    if not _VALUE.fullmatch(fields[0]):
        raise MetricsParseError(number, f"{name}: value {fields[0]!r} is not a number")
    timestamp = None
    if len(fields) == 2:
        if not _TIMESTAMP.fullmatch(fields[1]):
            raise MetricsParseError(number, f"{name}: timestamp {fields[1]!r} is not a number")
        timestamp = float(fields[1])
    return Sample(name, labels, float(fields[0]), timestamp)


def _parse_labels(line: str, pos: int, number: int) -> tuple[dict[str, str], int]:
    """Parse ``a="x",b="y"}`` starting after the ``{``; return the labels and the index after ``}``."""
    labels: dict[str, str] = {}
    while True:
        while pos < len(line) and line[pos] == " ":
            pos += 1
        if pos < len(line) and line[pos] == "}":
            return labels, pos + 1
        match = _LABEL_NAME.match(line, pos)
        if not match:
            raise MetricsParseError(number, f"bad label name at column {pos + 1}")
        key, pos = match.group(), match.end()
        if line[pos:pos + 2] != '="':
            raise MetricsParseError(number, f"label {key}: expected '=\"' at column {pos + 1}")
        value, pos = _parse_label_value(line, pos + 2, number, key)
        if key in labels:
            raise MetricsParseError(number, f"label {key} given twice")
        labels[key] = value
        if pos < len(line) and line[pos] == ",":
            pos += 1
        elif pos >= len(line) or line[pos] != "}":
            raise MetricsParseError(number, f"expected ',' or '}}' after label {key}")


def _parse_label_value(line: str, pos: int, number: int, key: str) -> tuple[str, int]:
    out: list[str] = []
    while pos < len(line):
        char = line[pos]
        if char == '"':
            return "".join(out), pos + 1
        if char == "\\":
            escaped = line[pos + 1:pos + 2]
            if escaped not in _ESCAPES:
                raise MetricsParseError(number, f"label {key}: invalid escape '\\{escaped}'")
            out.append(_ESCAPES[escaped])
            pos += 2
            continue
        out.append(char)
        pos += 1
    raise MetricsParseError(number, f"label {key}: unterminated value")
