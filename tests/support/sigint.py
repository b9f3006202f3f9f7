"""What Ctrl-C does in this process, read below Python: the C-level SIGINT disposition and
whether the calling thread blocks SIGINT.

signal.getsignal() only reports what Python last installed; a C extension that calls
sigaction() itself (SIG_IGN, or its own handler) or that blocks SIGINT in the main thread
leaves getsignal() unchanged while Ctrl-C no longer raises KeyboardInterrupt.

    state = sigint_state()        # ('python', False) in a plain interpreter
"""

from __future__ import annotations

import ctypes
import signal
from typing import NamedTuple

_libc = ctypes.CDLL(None, use_errno=True)


class _Sigaction(ctypes.Structure):
    # glibc's struct sigaction on Linux (x86_64 and aarch64): the handler union, a 1024-bit
    # sa_mask, sa_flags, then sa_restorer.
    _fields_ = [
        ("sa_handler", ctypes.c_void_p),
        ("sa_mask", ctypes.c_ulong * (1024 // (8 * ctypes.sizeof(ctypes.c_ulong)))),
        ("sa_flags", ctypes.c_int),
        ("sa_restorer", ctypes.c_void_p),
    ]


_libc.sigaction.argtypes = [ctypes.c_int, ctypes.POINTER(_Sigaction), ctypes.POINTER(_Sigaction)]


def c_handler(signum: int = signal.SIGINT) -> int:
    """The address the kernel calls for `signum` (0 for SIG_DFL, 1 for SIG_IGN)."""
    old = _Sigaction()
    if _libc.sigaction(signum, None, ctypes.byref(old)) != 0:
        raise OSError(ctypes.get_errno(), "sigaction")
    return old.sa_handler or 0


def _python_c_handler() -> int:
    """CPython's C handler (one function for every signal with a Python handler), read from a
    spare signal rather than from SIGINT, which a harness may have started ignored."""
    spare = signal.SIGUSR2
    previous = signal.signal(spare, lambda signum, frame: None)
    try:
        return c_handler(spare)
    finally:
        signal.signal(spare, previous)


PYTHON_C_HANDLER = _python_c_handler()


class SigintState(NamedTuple):
    disposition: str  # "python", "default", "ignore" or "foreign 0x..." (a C extension's)
    blocked: bool  # SIGINT in this thread's signal mask

    def describe(self) -> str:
        return f"C-level handler {self.disposition}" + (", blocked in the main thread" if self.blocked else "")


def sigint_state() -> SigintState:
    """Read (not change) SIGINT's C-level disposition and this thread's mask: a few µs."""
    address = c_handler()
    if address == PYTHON_C_HANDLER:
        disposition = "python"
    elif address == 0:
        disposition = "default"
    elif address == 1:
        disposition = "ignore"
    else:
        disposition = f"foreign {address:#x}"
    return SigintState(disposition, signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))


AT_IMPORT = sigint_state()
"""The state when the suite's conftest was loaded (before any test)."""
