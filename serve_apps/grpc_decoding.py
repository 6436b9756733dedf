"""warmpath's gRPC services as Ray Serve's proxy registers them, with requests that do not decode kept.

Why: the proxy decodes each request with the service's generated deserializer before any
warmpath code runs, and grpc answers a message that does not parse with UNKNOWN ("Unexpected
DecodeError"), which clients may treat as a server fault worth retrying. Here a request that
does not parse becomes an `UndecodableRequest`, which the proxy forwards like any request,
and `GrpcIngress` answers INVALID_ARGUMENT naming the message type.

`add_inference_servicer` and `add_agent_servicer` are `grpc_servicer_functions` entries in
place of the generated `add_*Servicer_to_server`: the same handlers, built from the services'
descriptors, with that one change to their deserializers.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import grpc
from google.protobuf.message import DecodeError, Message
from warmpath.v1 import agent_pb2, inference_pb2


@dataclass(frozen=True)
class UndecodableRequest:
    """A request whose bytes are not a valid `message_type`; `detail` is protobuf's reason, `num_bytes` its size
    (the API's size limit applies before its key is checked, as to any request)."""

    message_type: str
    detail: str
    num_bytes: int = 0


def tolerant_deserializer(message_class: type[Message]) -> Callable[[bytes], Any]:
    """`message_class.FromString`, or an `UndecodableRequest` where the bytes do not parse."""

    def deserialize(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError as err:
            return UndecodableRequest(message_class.DESCRIPTOR.full_name, str(err), len(data))

    return deserialize


def method_handlers(module: ModuleType, service_name: str, servicer: Any) -> dict[str, grpc.RpcMethodHandler]:
    """The generated `add_<service>Servicer_to_server`'s handlers, with tolerant request deserializers."""
    service = module.DESCRIPTOR.services_by_name[service_name]
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        if method.client_streaming:
            raise ValueError(f"{service.full_name}.{method.name}: client streaming is not served")
        request_class = getattr(module, method.input_type.name)
        response_class = getattr(module, method.output_type.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=tolerant_deserializer(request_class),
            response_serializer=response_class.SerializeToString,
        )
    return handlers


def _add_service(module: ModuleType, service_name: str, servicer: Any, server: Any) -> None:
    full_name = module.DESCRIPTOR.services_by_name[service_name].full_name
    handlers = method_handlers(module, service_name, servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(full_name, handlers),))
    server.add_registered_method_handlers(full_name, handlers)


def add_inference_servicer(servicer: Any, server: Any) -> None:
    """`grpc_servicer_functions` entry for `warmpath.v1.Inference` (module docstring)."""
    _add_service(inference_pb2, "Inference", servicer, server)


def add_agent_servicer(servicer: Any, server: Any) -> None:
    """`grpc_servicer_functions` entry for `warmpath.v1.Agent` (module docstring)."""
    _add_service(agent_pb2, "Agent", servicer, server)
