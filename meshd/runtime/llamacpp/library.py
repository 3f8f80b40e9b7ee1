"""The llama.cpp library as loaded through ``llama-cpp-python``: found once, initialised once, quiet.

``llama-cpp-python`` is an optional dependency built from source (``native/``); everything here
imports it lazily and says plainly when it is missing. llama.cpp's log lines go to meshd's logger
at debug level (they are many and mostly about loading), warnings and errors at their own level.
A few ggml functions that ``llama-cpp-python`` does not bind (a tensor's name, size and data, for
the evaluation callback that reads a range's output) are bound here from the same shared library.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path
from typing import Any

from meshd.errors import ModelFormatError

log = logging.getLogger("meshd.llamacpp")

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}
# ggml: 1 debug, 2 info, 3 warn, 4 error, 5 more. Its warnings are mostly advice about settings meshd
# chose on purpose (a KV pool larger than one training context, shared by many sequences): info here.
_GGML_LOG_LEVELS = {3: logging.INFO, 4: logging.ERROR}


class LlamaCppMissing(ModelFormatError):
    """llama-cpp-python is not installed here."""


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def library() -> Any:
    """The ``llama_cpp`` module, with the backend initialised and its logs routed to ours."""
    with _LOCK:
        if "lib" in _STATE:
            return _STATE["lib"]
        try:
            import llama_cpp
        except ImportError:
            raise LlamaCppMissing("the llama.cpp backend needs llama-cpp-python: run `make native` "
                                  "(docs/models.md, native/README.md)") from None
        llama_cpp.llama_backend_init()

        @llama_cpp.llama_log_callback
        def route(level: int, text: bytes, _user_data: Any) -> None:
            message = text.decode("utf-8", errors="replace").rstrip()
            if message:
                log.log(_GGML_LOG_LEVELS.get(level, logging.DEBUG), "%s", message)

        llama_cpp.llama_log_set(route, ctypes.c_void_p())
        _STATE["route"] = route  # the callback must outlive every call into the library
        _STATE["lib"] = llama_cpp
        return llama_cpp


class Ggml:
    """The ggml tensor accessors the evaluation callback needs."""

    def __init__(self) -> None:
        lib = library()
        path = Path(lib.llama_cpp._lib._name)
        base = ctypes.CDLL(str(path.with_name(path.name.replace("libllama", "libggml-base"))))
        base.ggml_get_name.restype = ctypes.c_char_p
        base.ggml_get_name.argtypes = [ctypes.c_void_p]
        base.ggml_nbytes.restype = ctypes.c_size_t
        base.ggml_nbytes.argtypes = [ctypes.c_void_p]
        base.ggml_backend_tensor_get.restype = None
        base.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        self._base = base

    def name(self, tensor: int) -> bytes:
        return bytes(self._base.ggml_get_name(tensor) or b"")

    def nbytes(self, tensor: int) -> int:
        return int(self._base.ggml_nbytes(tensor))

    def read(self, tensor: int, into: Any) -> None:
        """Copy the tensor's data (wherever its backend keeps it) into the numpy array ``into``."""
        self._base.ggml_backend_tensor_get(tensor, into.ctypes.data, 0, into.nbytes)


def ggml() -> Ggml:
    with _LOCK:
        if "ggml" not in _STATE:
            _STATE["ggml"] = None
    if _STATE["ggml"] is None:
        _STATE["ggml"] = Ggml()
    return _STATE["ggml"]
