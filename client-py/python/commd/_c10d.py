"""commd's C++ c10d backend shell (``_c10d.cpp``): built on first use against the torch in this
process with ``torch.utils.cpp_extension`` (a C++ compiler, ninja and Python's headers needed),
then loaded from torch's extension cache (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``) by every later process with the same torch and source.

``python -m commd._c10d`` builds it ahead of time (images, CI). ``COMMD_TORCH_EXT=0`` skips it:
commd.torch then hands torch its Python backend, with the limits torch puts on backends written
in Python (see commd.torch)."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from . import _settings

_SOURCE = Path(__file__).with_name("_c10d.cpp")
_loaded: ModuleType | None = None
_why_not: str | None = None


def _name() -> str:
    import torch
    ver = "".join(c if c.isalnum() else "_" for c in torch.__version__)
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:10]
    return f"commd_c10d_{ver}_{digest}"


def load(quiet: bool = False) -> ModuleType | None:
    """The extension module, built if needed; None (the reason in :func:`why_not`) when it is
    switched off or cannot be built here."""
    global _loaded, _why_not
    if _loaded is not None or _why_not is not None:
        return _loaded
    if not _settings.flag("COMMD_TORCH_EXT", True):
        _why_not = "switched off by COMMD_TORCH_EXT=0"
        return None
    try:
        from torch.utils import cpp_extension
        name = _name()
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        if not (build_dir / f"{name}.so").exists() and not quiet:
            print(f"commd: building the c10d backend extension for torch (once per torch version; "
                  f"in {build_dir})", file=sys.stderr, flush=True)
        _loaded = cpp_extension.load(name=name, sources=[str(_SOURCE)],
                                     extra_cflags=["-O2"], verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure falls back, with the reason
        # A failed build's text is the whole compiler command and output: keep its first error.
        lines = str(e).strip().splitlines()
        errs = [ln.strip() for ln in lines if " error" in ln or ln.lstrip().startswith("error")]
        _why_not = f"{type(e).__name__}: {(errs or lines or [''])[0]}"[:500]
        return None
    return _loaded


def why_not() -> str | None:
    """Why :func:`load` returned None (None when it did not)."""
    return _why_not


def wrap(impl: Any, rank: int, size: int, timeout_s: float) -> Any:
    mod = load()
    assert mod is not None
    return mod.wrap(impl, rank, size, timeout_s)


if __name__ == "__main__":
    m = load()
    if m is None:
        print(f"commd: the c10d extension was not built: {why_not()}", file=sys.stderr)
        sys.exit(1)
    print(f"commd: c10d extension ready: {m.__file__}")
