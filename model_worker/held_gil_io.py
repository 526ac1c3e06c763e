"""The link thread's non-blocking reads and sends, made without letting go of the GIL.

Runs in the worker process, on its link thread (model_worker.link_thread). Owns nothing but C
functions bound once per process: libc's `read` and libzmq's `zmq_send`, called through
`ctypes.PyDLL`, which keeps the GIL across the call.

Why: `os.read` and pyzmq's `send` let go of the GIL around their system call, as a call that may
block must. The link thread's calls never block (a read of its non-blocking doorbell, a send with
ZMQ_DONTWAIT), yet each time it lets go the engine thread takes the GIL, and the link thread then
waits for the engine thread's next kernel launch to get it back, while the engine thread, in its
turn, sleeps until the link thread is done. With these calls a frame costs the engine thread one
such hand-over instead of three. The doorbell's poll still lets go: it waits.

`zmq_send` is looked up through pyzmq's own compiled extension, so it is the libzmq that pyzmq
calls; pyzmq documents `Socket.underlying` for such calls from other bindings. Where the lookup
fails (pyzmq's cffi backend, a libzmq linked in without its symbols), `available()` is False and
the link thread uses the Python calls.
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Any

import zmq

_BELL_BUFFER_BYTES = 4096


def _bind() -> tuple[Any, Any, Any] | None:
    try:
        from zmq.backend.cython import _zmq  # pyzmq's compiled backend (not on PyPy's cffi one)

        # Looked up through the extension itself, so the symbol is the libzmq it calls: dlsym searches
        # a library and then its dependencies, in load order.
        libzmq = ctypes.PyDLL(_zmq.__file__)
        libc = ctypes.PyDLL(None, use_errno=True)
        zmq_send, zmq_errno, read = libzmq.zmq_send, libzmq.zmq_errno, libc.read
    except (ImportError, OSError, AttributeError):  # a libzmq linked in without its symbols, say
        return None
    zmq_send.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
    zmq_send.restype = ctypes.c_int
    zmq_errno.argtypes = []
    zmq_errno.restype = ctypes.c_int
    read.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    read.restype = ctypes.c_ssize_t
    return zmq_send, zmq_errno, read


_BOUND = _bind()


def available() -> bool:
    return _BOUND is not None


class HeldGilIO:
    """One socket's sends and one doorbell's reads, each keeping the GIL; only on the thread that
    owns the socket."""

    def __init__(self, sock: zmq.Socket, bell_fd: int) -> None:
        assert _BOUND is not None, "check available() first"
        self._zmq_send, self._zmq_errno, self._read = _BOUND
        self._handle = ctypes.c_void_p(sock.underlying)
        self._bell_fd = bell_fd
        self._buffer = ctypes.create_string_buffer(_BELL_BUFFER_BYTES)

    def send_nowait(self, frame: bytes) -> bool:
        """Hand ZeroMQ one frame; False if its queue to the peer is full (the frame was not taken).
        Raises ZMQError as pyzmq would for any other failure."""
        while self._zmq_send(self._handle, frame, len(frame), zmq.DONTWAIT) < 0:
            code = self._zmq_errno()
            if code == errno.EAGAIN:
                return False
            if code != errno.EINTR:
                raise zmq.ZMQError(code)
        return True

    def clear_bell(self) -> None:
        """Read the doorbell until it is empty: a short read has emptied it."""
        while (count := self._read(self._bell_fd, self._buffer, _BELL_BUFFER_BYTES)) == _BELL_BUFFER_BYTES:
            pass
        if count < 0 and (code := ctypes.get_errno()) not in (errno.EAGAIN, errno.EINTR):
            raise OSError(code, os.strerror(code))
