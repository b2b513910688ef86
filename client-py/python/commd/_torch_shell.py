"""The backend's C++ shell (``commd._c10d``) as ``commd.torch`` uses it: loaded once, and where
it cannot be built, said once on stderr with ``Work.is_completed`` patched to answer from the
Work's future (see the ``commd.torch`` docstring); and the message of a feature that needs it."""

from __future__ import annotations

import sys
from typing import Any

from torch._C._distributed_c10d import Work as _Work


def _shell() -> Any:
    """The C++ shell module (``commd._c10d``), built on first use; None where it cannot be,
    after saying so once and patching ``Work.is_completed`` (see the module docstring)."""
    from . import _c10d
    mod = _c10d.load()
    if mod is None and not getattr(_shell, "_said", False):
        _shell._said = True  # type: ignore[attr-defined]
        print(f"commd: the torch backend runs without its C++ shell ({_c10d.why_not()}): "
              "recv(src=None) and split_group are refused, Work.is_completed is patched, and "
              "ordinary CPU tensors are staged (copied for every op; commd.torch.empty runs in "
              "place); "
              "`python -m commd._c10d` shows why it cannot be built", file=sys.stderr,
              flush=True)
        _patch_is_completed()
    return mod


def _no_shell(what: str) -> str:
    from . import _c10d
    return (f"commd: {what} needs the backend's C++ shell, which could not be built here "
            f"({_c10d.why_not()}); run `python -m commd._c10d` to see why")


def _patch_is_completed() -> None:
    """Only without the C++ shell: torch (2.15) wraps every Work a Python backend returns in a
    holder that forwards only ``wait`` and ``get_future``, so ``is_completed()`` on it is always
    False. Our async Works complete their future when the op finishes; this makes
    ``is_completed()`` fall back to that future. Works of other backends are unaffected: their
    own answer is used first, and their future is never done before they are."""
    orig = _Work.is_completed
    if getattr(orig, "_commd_patched", False):
        return

    def is_completed(self: _Work) -> bool:
        if orig(self):
            return True
        try:
            return bool(self.get_future().done())
        except Exception:  # noqa: BLE001 - a Work without a future keeps its own answer
            return False

    is_completed._commd_patched = True  # type: ignore[attr-defined]
    is_completed.__doc__ = orig.__doc__
    _Work.is_completed = is_completed  # type: ignore[method-assign]
