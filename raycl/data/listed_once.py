"""Each dataset root listed once per launch, or per trial.

Before a sweep starts, several checks ask for the same folder's listing (the data check, the
split sizes behind the batch and feasibility checks, ``data.loader: auto``'s size), and a trial
asks again for its split sizes and its data. Listing ImageNet in a bucket is a thousand
requests per million files, so within a :func:`listed_once` scope a listing is made once and
then reused. Outside a scope nothing is kept: a long-lived process (a notebook, the test
suite) never sees a folder as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

T = TypeVar("T")

_listings: ContextVar[dict[Hashable, Any] | None] = ContextVar("raycl_listings", default=None)


@contextmanager
def listed_once() -> Iterator[None]:
    """Within: :func:`remembered` lists each key once. Nested scopes share the outermost's."""
    if _listings.get() is not None:
        yield
        return
    token = _listings.set({})
    try:
        yield
    finally:
        _listings.reset(token)


def remembered(key: Hashable, list_it: Callable[[], T]) -> T:
    """``list_it()``, or inside a :func:`listed_once` scope what it returned for ``key`` the
    first time (an error is not remembered: it is raised again by the next call)."""
    listings = _listings.get()
    if listings is None:
        return list_it()
    if key not in listings:
        listings[key] = list_it()
    return listings[key]


__all__ = ["listed_once", "remembered"]
