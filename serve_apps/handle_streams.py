"""Streaming handle calls that stop when whoever reads them stops.

Why: when a caller leaves (a closed HTTP stream), Ray Serve cancels the request
it was serving, but a `DeploymentResponseGenerator` whose reader is cancelled
re-raises without cancelling its own call (`ray/serve/handle.py`): whether the
streaming calls the request made stop too rests on Ray cancelling the request's
child tasks. Each ingress and the orchestrator cancel the call they stopped
reading themselves, so an engine never decodes on to `max_tokens` for nobody.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator

logger = logging.getLogger("ray.serve")


@contextmanager
def cancelled_if_left(stream: Any, is_answered: Callable[[], bool] = lambda: False) -> Iterator[None]:
    """Cancels the streaming handle call `stream` (a `DeploymentResponseGenerator`) if the block is left by an
    exception: the reader was cancelled or closed (its caller left) or failed; a block that read the stream
    to its end leaves it be, and so does a reader closed once `is_answered()` (it has the whole answer
    it came for, a call that ends with it). Cancelling a call that has ended does nothing."""
    try:
        yield
    except GeneratorExit:
        if not is_answered():
            _cancel(stream)
        raise
    except BaseException:
        _cancel(stream)
        raise


def _cancel(stream: Any) -> None:
    """Cancels `stream`'s call; a failure to cancel is logged, never raised in place of what is going on."""
    cancel = getattr(stream, "cancel", None)  # a plain async iterator (a test's stand-in) has nothing to stop
    if cancel is not None:
        try:
            cancel()
        except Exception:  # never in place of what is going on: the caller's leaving, or the failure
            logger.warning("could not cancel a streaming handle call", exc_info=True)
