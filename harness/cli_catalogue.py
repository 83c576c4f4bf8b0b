"""``python -m harness list models|strategies|options|markers``: what a suite file, a
``-m`` expression and ``plan`` accept, read from the declarations themselves (the presets, the
strategy files, the config dataclasses, the marker catalogue), so the listing cannot drift
from what the checks allow."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable

from harness import markers, strategies
from harness.config import MAX_COUNT, TYPE_WORDS, CellSpec, StrategySpec
from harness.models import presets
from harness.models.built import analytic_n_params

CATALOGUES = ("models", "strategies", "options", "markers")


def render(what: str) -> str:
    """The catalogue ``what`` (one of CATALOGUES) as plain text."""
    shown: dict[str, Callable[[], str]] = {"models": _models, "strategies": _strategies, "options": _options,
                                           "markers": _markers}
    return shown[what]()


def _models() -> str:
    lines = [f"{'model':<16} {'family':<8} {'parameters':>14}  {'sizes':<30} use"]
    for name, spec in presets.PRESETS.items():
        sizes = f"{spec.n_layers} layers × {spec.hidden}" + (f", {spec.seq_len} tokens" if spec.seq_len else "")
        use = (f"planning only: {presets.PLANNING_ONLY[name]}" if name in presets.PLANNING_ONLY
               else "real size (GPU runs and plan)" if name in presets.REAL_SIZE_PRESETS else "CPU tests")
        lines.append(f"{name:<16} {spec.family:<8} {analytic_n_params(spec):>14,}  {sizes:<30} {use}")
    lines.append("A suite file's model can also be a transformers config.json, or a table {config = \"path\","
                 " key = value, …} overriding its keys (README: Models).")
    return "\n".join(lines)


def _strategies() -> str:
    blocks = []
    for declared in strategies.declarations():
        can = declared.capabilities
        composes = [
            ("precision", sorted(can.precisions)), ("checkpointing", sorted(can.checkpointing)),
            ("offload", sorted(can.offload)), ("optimizer", sorted(can.optimizers)),
            ("compression", sorted(can.compression)),
            ("overlap options", sorted(can.overlap_options)),
            ("layout options", [f"{k} (default {v})" for k, v in declared.options.items()]),
        ]
        switches = [name for name, on in (("accumulation", can.accumulation), ("clip_grad_norm", can.clipping),
                                          ("sync_batch_norm", can.sync_batch_norm),
                                          ("local_sgd_period", can.local_sgd)) if on]
        low, high = can.min_world_size, can.max_world_size
        ranks = f"{low} or more" if high is None else f"{low}" if high == low else f"{low} to {high}"
        block = [f"{declared.name}: {declared.summary}", f"  world size: {ranks}"]
        block += [f"  {label}: {', '.join(values)}" for label, values in composes if values]
        block.append("  also takes: " + (", ".join(switches) if switches else "none of accumulation, clip_grad_norm,"
                                                                          " sync_batch_norm, local_sgd_period"))
        if declared.superseded_by:
            block.append(f"  superseded by {declared.superseded_by} (plan does not recommend it)")
        blocks.append("\n".join(block))
    return "\n\n".join(blocks) + ("\n\nA value a strategy does not list is refused when the suite is built,"
                                  " naming why (`python -m harness list --suite ...` shows the cells).")


def _options() -> str:
    rows = [("strategy", "one of " + ", ".join(strategies.names()), "(required)"),
            ("model", "a preset (list models), a config.json path or a {config = ...} table", "(required)")]
    for spec_type in (CellSpec, StrategySpec):
        hints = typing.get_type_hints(spec_type)
        for f in dataclasses.fields(spec_type):
            if not f.init or f.name in ("model", "strategy", "name"):
                continue
            default = ("the run's ranks (--gpus × nodes)" if f.name == "world_size"
                       else "unset" if f.default is None else repr(f.default))
            rows.append((f.name, _allowed(hints[f.name]), f"default {default}"))
    width = max(len(name) for name, _, _ in rows)
    lines = [f"{name:<{width}}  {allowed}; {default}" for name, allowed, default in rows]
    return "\n".join(["Cell options, as a suite file's [[cells]] tables take them (a list is an axis):", *lines,
                      f"Counts are at most {MAX_COUNT:,}; every value is checked by type and range before anything"
                      " runs, and a refusal names what is allowed (README: Suites of your own)."])


def _allowed(hint: object) -> str:
    """A field's type hint in words: its choices, or its plain types."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    words = []
    for option in options:
        if typing.get_origin(option) is typing.Literal:
            words.append("one of " + ", ".join(str(v) for v in typing.get_args(option)))
        else:
            words.append(TYPE_WORDS.get(option, getattr(option, "__name__", str(option))))
    return " or ".join(words)


def _markers() -> str:
    sizes = [name for name in markers.CATALOGUE if name.startswith("ws") and name[2:].isdigit()]
    width = max(len(name) for name in markers.CATALOGUE)
    lines = [f"{name:<{width}}  {text}" for name, text in {**markers.CATALOGUE, **markers.TEST_MARKERS}.items()
             if name not in sizes]
    lines.append(f"{'ws<N>':<{width}}  world size N, for N in {', '.join(s[2:] for s in sizes[:12])}, … up to"
                 f" {sizes[-1][2:]} (powers of two and multiples of 8)")
    return "\n".join(["Markers for -m (every cell carries one per axis value, and its families):", *lines])
