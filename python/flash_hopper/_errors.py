"""Exception types of flash-hopper.

Each one subclasses the builtin a caller would naturally catch (``RuntimeError``,
``NotImplementedError``), so code written against FlashAttention's Python API keeps working, while
``except flash_hopper.LibraryNotFoundError`` etc. stays possible for callers that care.
"""


class LibraryNotFoundError(RuntimeError):
    """libflash_hopper.so could not be found or loaded, or its ABI version does not match."""


class UnsupportedError(NotImplementedError):
    """A valid request that this build or this GPU cannot serve (no kernel instantiated for it)."""


class CudaError(RuntimeError):
    """A CUDA runtime or driver call failed; the message carries CUDA's error name and string."""


class InternalError(RuntimeError):
    """A bug in flash-hopper (the library reported FH_ERROR_INTERNAL or an unknown status)."""


class DeviceQueryError(RuntimeError):
    """No CUDA device could be queried (CPU-only machine, no driver, bad device index)."""
