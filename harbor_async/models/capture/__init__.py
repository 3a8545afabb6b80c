"""The capture proxy (issue 47, first part): every model call of an agent recorded, with its tokens where the server gives them.

:class:`CaptureProxy` serves an OpenAI-compatible endpoint on 127.0.0.1 and
forwards to the real model server; each episode's agent gets a session of its
own (:class:`CaptureSession`, named by its API key). Not yet wired into
episodes, records or the trainer: see the module docs of :mod:`.proxy`.
"""

from harbor_async.models.capture.proxy import (
    CaptureLimits,
    CaptureProxy,
    CaptureProxyError,
)
from harbor_async.models.capture.trace import CapturedCall, CaptureSession

__all__ = ["CaptureLimits", "CaptureProxy", "CaptureProxyError", "CapturedCall", "CaptureSession"]
