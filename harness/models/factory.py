"""Family factory: a model of one's own, from ``package.module:function`` (README: Models).

The function takes no arguments and returns ``(module, make_batch)``: an ``nn.Module`` and
``make_batch(generator, batch_size) -> dict[str, Tensor]``, which draws from ``generator``
only and puts the batch first in every tensor. The loss is ``module(**batch).loss`` where the
output has one (a transformers model given labels), else the output itself, a scalar mean
over the samples. The harness seeds the CPU generator before calling the function, as for
every model, so each rank builds the same weights; the module must be importable on every
rank (on the PYTHONPATH the launcher hands to torchrun).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch import nn

from .common import ParamCount, counted_on_meta
from .spec import ModelSpec

MakeBatch = Callable[[torch.Generator, int], dict[str, torch.Tensor]]


def load(path: str) -> Callable[[], tuple[nn.Module, MakeBatch]]:
    """The function ``path`` names, or a ValueError saying why it cannot be used."""
    module_name, _, function_name = path.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"factory {path!r}: name it package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"factory {path!r}: cannot import {module_name} ({error}); is it on the PYTHONPATH?") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"factory {path!r}: {module_name} has no function {function_name}")
    return function


def made(path: str) -> tuple[nn.Module, MakeBatch]:
    result = load(path)()
    if (not isinstance(result, tuple) or len(result) != 2 or not isinstance(result[0], nn.Module)
            or not callable(result[1])):
        raise ValueError(f"factory {path!r}: must return (nn.Module, make_batch(generator, batch_size))")
    return result


def build_module(spec: ModelSpec, attention: str = "sdpa") -> nn.Module:
    module, make_batch = made(_path(spec))
    _BATCHES[_path(spec)] = make_batch
    return module


def make_batch(spec: ModelSpec, generator: torch.Generator, batch_size: int) -> dict[str, torch.Tensor]:
    if _path(spec) not in _BATCHES:
        build_module(spec)  # the function's batches come with its module
    return _BATCHES[_path(spec)](generator, batch_size)


def loss(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    output = module(**batch)
    value: torch.Tensor = output.loss if hasattr(output, "loss") else output
    return value


def count_params(spec: ModelSpec) -> ParamCount:
    return counted_on_meta(build_module, spec)


# The make_batch each factory returned in this process (a module cannot be rebuilt just to get it).
_BATCHES: dict[str, MakeBatch] = {}


def _path(spec: ModelSpec) -> str:
    if spec.factory is None:
        raise ValueError(f"model {spec.name}: family factory without a factory")
    return spec.factory
