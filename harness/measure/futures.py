"""Future callbacks and the per-thread dispatch modes the measurements use.

A TorchDispatchMode is per-thread state, and ``torch.futures.Future.then`` runs its callback
on whichever thread completes the future: the thread that attaches it when the future is
already complete, else the one that completes it (gloo's worker thread for a collective's
future). What a comm hook's callbacks do (PowerSGD's all-reduces and temporaries) would then
be seen by a mode, or not, depending on timing. ``callbacks_under(context)`` takes timing
out: every callback attached inside the block runs inside ``context()``, on whichever thread
runs it. A callback that starts after the block has closed runs as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode


@contextmanager
def callbacks_under(context: Callable[[], AbstractContextManager[object]]) -> Iterator[None]:
    future_cls = torch._C.Future
    original_then = future_cls.__dict__["then"]
    active = [True]

    def then(self: torch.Future[Any], callback: Callable[[torch.Future[Any]], Any]) -> torch.Future[Any]:
        @functools.wraps(callback)
        def wrapped(fut: torch.Future[Any]) -> Any:
            if not active[0]:
                return callback(fut)
            with context():
                return callback(fut)

        return original_then(self, wrapped)  # type: ignore[no-any-return]  # from the class's __dict__

    future_cls.then = then  # type: ignore[method-assign]  # patched for the block, restored below
    try:
        yield
    finally:
        active[0] = False
        future_cls.then = original_then  # type: ignore[method-assign]


@contextmanager
def without_modes_of(mode_type: type) -> Iterator[None]:
    """This thread's dispatch modes less those of ``mode_type``, the others (a fake tensor
    mode) kept in their order; nothing changes on a thread that has none of them."""
    stack = _get_current_dispatch_mode_stack()  # outermost (bottom of the stack) first
    if not any(isinstance(mode, mode_type) for mode in stack):
        yield
        return
    for _ in stack:
        _pop_mode()
    kept = [mode for mode in stack if not isinstance(mode, mode_type)]
    for mode in kept:
        _push_mode(mode)
    try:
        yield
    finally:
        for _ in kept:
            _pop_mode()
        for mode in stack:
            _push_mode(mode)
