"""The Python package's one reader of commd settings.

Every ``COMMD_*`` variable the package reads is an entry of commd's settings registry
(``settings/src/keys.rs``: name, default, range, meaning, reader), whose names the native module
lists; ``commd config --client`` prints their effective values. Reading a name the registry does
not have raises, so a setting cannot be read without being documented. Modules of the package
read settings only through this one (``tests/test_settings.py`` checks it)."""

from __future__ import annotations

import os

from . import _native

_NAMES = frozenset(_native.setting_names())


def get(name: str) -> str:
    """The value of setting ``name``, stripped ("" when unset)."""
    if name not in _NAMES:
        raise KeyError(f"{name} is not in commd's settings registry (settings/src/keys.rs)")
    return os.environ.get(name, "").strip()


def raw(name: str) -> str | None:
    """The value of setting ``name`` as set, unstripped (None when unset), for error messages
    that quote it."""
    get(name)
    return os.environ.get(name)


def flag(name: str, default: bool) -> bool:
    """A switch: ``default`` when unset or empty; off for 0/off/false/no (any case), else on."""
    v = get(name).lower()
    if not v:
        return default
    return v not in ("0", "off", "false", "no")


def size(name: str, default: int) -> int:
    """A byte count: an integer with an optional K, M or G (binary); ``default`` when unset."""
    v = get(name)
    if not v:
        return default
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(v[-1].lower(), 1)
    try:
        n = int(v[:-1] if mult != 1 else v) * mult
    except ValueError:
        raise ValueError(f"{name}={v!r} is not a byte count (e.g. 1048576, 512K, 1M)") from None
    if n < 0:
        raise ValueError(f"{name}={v!r} is negative")
    return n


def gbps(name: str) -> float | None:
    """A GB/s value (unset or empty: None)."""
    v = get(name)
    if not v:
        return None
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"{name}={v!r}: expected a number of GB/s (0: uncapped)") from None
