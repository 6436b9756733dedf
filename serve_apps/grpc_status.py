"""gRPC status of warmpath's services: HTTP-status mapping, expected failures, health checking.

Two concerns that both decide what a gRPC client sees as "status":

- Mapping. The orchestrator answers with HTTP-style envelopes
  (`{"status", "body": {"error": {"message", "code"}}}`) and the engine with
  HTTP error codes; `grpc_code` turns them into gRPC codes. 409 splits in two:
  a lost race (`session_busy`, `stale_turn`: retrying can succeed) is ABORTED,
  any other state conflict (pending tool calls, no calls pending) is
  FAILED_PRECONDITION. Statuses without a row map to UNKNOWN, as gRPC's own
  HTTP mapping does.
- Details. A status' details travel percent-encoded in the `grpc-message`
  trailer, and clients drop a call whose trailers pass 8 KiB (soft limit)
  or 16 KiB (hard): `status_details` cuts every long token of a message (an
  id or a name the caller sent, echoed back) to `MAX_ECHOED_CHARS` and the
  whole to `MAX_DETAILS_BYTES`, so no request can turn a readable failure
  into RESOURCE_EXHAUSTED. Every `RpcFailure` message passes through it.
- Health. `add_health_servicer_to_server` is a `grpc_servicer_functions` entry
  that hosts the standard `grpc.health.v1.Health` service inside Ray Serve's
  gRPC proxy (not in a replica), so probes need no `application` metadata and
  answer even while no replica runs. Its verdict is the proxy's own: Ray's
  `/ray.serve.RayServeAPIService/Healthz` logic (route table populated, node
  not draining), called in-process.

Nothing here imports the engine or the orchestrator: the proxy imports this
module at start-up. The hooks into the proxy (`add_passthrough_service`,
`service_handler_factory`) are Ray Serve 2.60 internals, pinned with Ray.
"""

from __future__ import annotations

import re
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from ray.serve._private.proxy_request_response import gRPCStreamingType
from ray.serve.generated.serve_pb2 import HealthzRequest
from warmpath.v1 import agent_pb2, inference_pb2

HTTP_TO_GRPC: Mapping[int, grpc.StatusCode] = {
    200: grpc.StatusCode.OK,
    201: grpc.StatusCode.OK,
    204: grpc.StatusCode.OK,
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,  # what gRPC itself answers for a message over its limit
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    501: grpc.StatusCode.UNIMPLEMENTED,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

# 409 error codes that mean "another request won a race": the caller may retry as is.
ABORTED_ERROR_CODES = frozenset({"session_busy", "stale_turn"})

RAY_HEALTHZ_METHOD = "/ray.serve.RayServeAPIService/Healthz"

# Longest token (an id, a name: anything between spaces and quotes) a status message echoes whole.
MAX_ECHOED_CHARS = 64
# Details as UTF-8; percent-encoding at most triples them, which stays under gRPC's 8 KiB metadata soft limit.
MAX_DETAILS_BYTES = 2048
ELLIPSIS = "..."
_LONG_TOKEN = re.compile(r"[^\s'\"`]{%d,}" % (MAX_ECHOED_CHARS + 1))


def shorten(text: str, max_chars: int = MAX_ECHOED_CHARS) -> str:
    """`text`, or its first `max_chars` characters and "..." when longer."""
    return text if len(text) <= max_chars else text[:max_chars] + ELLIPSIS


def status_details(message: str) -> str:
    """`message` fit for a status' details: long tokens shortened, at most `MAX_DETAILS_BYTES` of UTF-8.

    Args:
        message: A readable failure, possibly echoing what the caller sent (a 100 KB session id).

    Returns:
        The message with each token over `MAX_ECHOED_CHARS` cut by `shorten`, then cut (with "...")
        to `MAX_DETAILS_BYTES` bytes of UTF-8, never inside a character.
    """
    text = _LONG_TOKEN.sub(lambda match: shorten(match.group()), message)
    encoded = text.encode("utf-8")
    if len(encoded) <= MAX_DETAILS_BYTES:
        return text
    return encoded[: MAX_DETAILS_BYTES - len(ELLIPSIS)].decode("utf-8", errors="ignore") + ELLIPSIS


def grpc_code(http_status: int, error_code: str | None = None) -> grpc.StatusCode:
    """The gRPC code for an HTTP-style status and, for 409, the API's machine-readable error code.

    Args:
        http_status: Status of an orchestrator envelope or an engine error.
        error_code: The API's `error.code` (e.g. `session_busy`), when there is one.

    Returns:
        The mapped code; UNKNOWN for statuses without a mapping.
    """
    if http_status == 409 and error_code in ABORTED_ERROR_CODES:
        return grpc.StatusCode.ABORTED
    return HTTP_TO_GRPC.get(http_status, grpc.StatusCode.UNKNOWN)


class RpcFailure(Exception):
    """An expected failure of one RPC: gRPC code, the API's error code, and readable details.

    `message` is the given text through `status_details`, so the status details and the
    stream's last message (which carries the same text) stay bounded whatever the caller sent.
    """

    def __init__(
        self, status: grpc.StatusCode, code: str, message: str, trailing_metadata: Sequence[tuple[str, str]] = ()
    ) -> None:
        message = status_details(message)
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.trailing_metadata = tuple(trailing_metadata)
        # Whether the exception it stands for is in the log already (Ray Serve LLM logs what it classifies).
        self.is_logged = False
        self.replica_id = ""  # the replica that answered with this failure, where one did

    @classmethod
    def from_envelope(cls, envelope: Mapping[str, Any]) -> "RpcFailure":
        """The failure an orchestrator error envelope (`{"status", "body": {"error": ...}}`) describes."""
        error = (envelope.get("body") or {}).get("error") or {}
        code = str(error.get("code") or "error")
        message = str(error.get("message") or f"request failed with status {envelope['status']}")
        return cls(grpc_code(int(envelope["status"]), code), code, message)

    def set_on(self, grpc_context) -> None:
        """Writes the code, details and trailing metadata (if any) onto a servicer context (grpc's or Ray Serve's)."""
        grpc_context.set_code(self.status)
        grpc_context.set_details(self.message)
        if self.trailing_metadata:
            grpc_context.set_trailing_metadata(list(self.trailing_metadata))


# Ray's proxy handler for one method: (request proto, servicer context) -> response bytes.
ProxyHandler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[bytes]]


class ProxyHealthServicer(health_pb2_grpc.HealthServicer):
    """`grpc.health.v1.Health` answered by the proxy's own readiness (Ray's Healthz).

    `Check` answers SERVING when Ray's Healthz succeeds and NOT_SERVING when it
    fails (no route table yet, node draining), always with an OK RPC status as
    the health protocol asks; services other than the overall server ("") and
    `service_names` are NOT_FOUND. `Watch` and `List` are UNIMPLEMENTED with a
    readable message (gRPC clients treat that as "health watching unsupported").
    """

    def __init__(self, service_names: Iterable[str], ray_healthz: ProxyHandler) -> None:
        self._service_names = frozenset(service_names) | {health.OVERALL_HEALTH}
        self._ray_healthz = ray_healthz

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext):
        if request.service not in self._service_names:
            await context.abort(grpc.StatusCode.NOT_FOUND, status_details(f"unknown service {request.service!r}"))
        await self._ray_healthz(HealthzRequest(), context)
        code = context.code()
        if code is not None and code != grpc.StatusCode.OK:
            # Ray reports "not ready" as a failed RPC; the health protocol reports it as a status.
            context.set_code(grpc.StatusCode.OK)
            context.set_details("")
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "use Check; Watch is not served by the proxy")
        yield health_pb2.HealthCheckResponse()  # unreachable: makes this a server-streaming handler

    async def List(self, request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "use Check; List is not served by the proxy")


def warmpath_service_names() -> list[str]:
    """Full names of the services `GrpcIngress` implements."""
    return [
        inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
        agent_pb2.DESCRIPTOR.services_by_name["Agent"].full_name,
    ]


def add_health_servicer_to_server(servicer: object, server) -> None:
    """`grpc_servicer_functions` entry: serve `grpc.health.v1.Health` in the proxy itself.

    Ray's proxy calls every listed function with a placeholder servicer (ignored
    here) and its `gRPCGenericServer`, which reroutes each registered service to
    the application's replicas unless the service is marked passthrough. Marking
    Health passthrough first keeps its handlers on the proxy; Ray's own server
    reflection uses the same mechanism. Reflection then lists Health too,
    because it advertises every service registered before it.

    Args:
        servicer: Ray's placeholder servicer; unused.
        server: The proxy's `gRPCGenericServer`.
    """
    ray_healthz = server.service_handler_factory(
        service_method=RAY_HEALTHZ_METHOD, streaming_type=gRPCStreamingType.UNARY_UNARY
    )
    server.add_passthrough_service(health.SERVICE_NAME)
    health_pb2_grpc.add_HealthServicer_to_server(ProxyHealthServicer(warmpath_service_names(), ray_healthz), server)
