"""OpenAI-compatible HTTP ingress: Ray Serve LLM's `OpenAiIngress` plus headers.

Why a subclass: every response must say which replica served it
(`x-warmpath-replica`) and, once the prefix-aware router decided, why
(`x-warmpath-route`, `x-warmpath-predicted-cached-tokens`). The replica names
itself in the first item of its stream (`serve_apps.vllm_replica.ServedBy`);
this class strips that record and turns it into headers. Request parsing,
model lookup (404 for unknown models), error mapping and SSE framing are
Ray Serve LLM's.
"""

from __future__ import annotations

from typing import Dict, Optional

from fastapi import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ray.llm._internal.serve.core.configs.openai_api_models import ErrorResponse, OpenAIHTTPException
from ray.llm._internal.serve.core.ingress.ingress import (
    DEFAULT_ENDPOINTS,
    OpenAiIngress,
    router_request_timeout,
)
from ray.llm._internal.serve.constants import DEFAULT_LLM_ROUTER_HTTP_TIMEOUT
from ray.llm._internal.serve.core.ingress.utils import (
    NON_STREAMING_RESPONSE_TYPES,
    _openai_json_wrapper,
    _peek_at_generator,
)

from router.decision_log import DECISIONS
from serve_apps.vllm_replica import ServedBy

REPLICA_HEADER = "x-warmpath-replica"
ROUTE_HEADER = "x-warmpath-route"
PREDICTED_CACHED_HEADER = "x-warmpath-predicted-cached-tokens"


def _headers(served_by: Optional[ServedBy]) -> Dict[str, str]:
    """Replica header, plus the router's reason and prediction when warmpath's router decided."""
    from ray.serve.context import _get_serve_request_context

    headers: Dict[str, str] = {}
    decision = DECISIONS.pop(_get_serve_request_context().request_id)
    if served_by is not None:
        headers[REPLICA_HEADER] = served_by.replica_id
    if decision is not None:
        headers[ROUTE_HEADER] = decision.reason
        replica = served_by.replica_id if served_by is not None else decision.replica_id
        headers[PREDICTED_CACHED_HEADER] = str(decision.predicted_cached_tokens.get(replica, 0))
    return headers


class WarmpathIngress(OpenAiIngress):
    """OpenAI routes that report the serving replica in response headers."""

    async def _process_llm_request(self, body, call_method: str, raw_request: Optional[Request] = None) -> Response:
        async with router_request_timeout(DEFAULT_LLM_ROUTER_HTTP_TIMEOUT):
            gen = self._get_response(body=body, call_method=call_method, raw_request=raw_request)
            served_by: Optional[ServedBy] = None
            first, gen = await _peek_at_generator(gen)
            if isinstance(first, ServedBy):
                served_by = first
                await gen.__anext__()  # the peeked tag itself
                first, gen = await _peek_at_generator(gen)
            first_chunk = first[0] if isinstance(first, list) else first
            if isinstance(first_chunk, ErrorResponse):
                raise OpenAIHTTPException(
                    message=first_chunk.error.message,
                    status_code=first_chunk.error.code,
                    type=first_chunk.error.type,
                )
            headers = _headers(served_by)
            if isinstance(first_chunk, NON_STREAMING_RESPONSE_TYPES):
                return JSONResponse(content=first_chunk.model_dump(), headers=headers)
            return StreamingResponse(_openai_json_wrapper(gen), media_type="text/event-stream", headers=headers)

    async def health(self) -> JSONResponse:
        """Liveness of the ingress and the models it routes to."""
        return JSONResponse({"status": "ok", "models": sorted(self._model_cards)})


ENDPOINTS = {
    **{name: DEFAULT_ENDPOINTS[name] for name in ("models", "model_data", "completions", "chat", "tokenize", "detokenize")},
    "health": lambda app: app.get("/health"),
}
