"""How rayturn's gRPC request messages are decoded, so that a malformed one is INVALID_ARGUMENT, not UNKNOWN.

grpcio decodes a request with the method's ``request_deserializer`` before
any handler runs; when protobuf raises ``DecodeError`` (bytes that are not a
message of that type: truncated, a wrong wire type, a string field that is
not UTF-8), grpcio itself answers UNKNOWN with the exception's text. Serve
registers a servicer through the function ``SERVICER_FUNCTION`` names and
keeps each method's deserializer (it replaces only the handlers), so
``add_servicer`` registers rayturn's methods with a deserializer that never
raises: bytes that do not decode become an ``UndecodableRequest``, which
crosses to the ingress replica like any request; ``GrpcService`` answers it
with INVALID_ARGUMENT naming the message type::

    bytes --> FromString --> request message ----------> GrpcService method
                  \\--> DecodeError --> UndecodableRequest --> INVALID_ARGUMENT
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from rayturn.protos import rayturn_pb2 as pb

from .errors import invalid_request

SERVICE_NAME = "rayturn.v1.RayTurn"
# Dotted path of ``add_servicer``, in the form Ray Serve's gRPC options take it.
SERVICER_FUNCTION = f"{__name__}.add_servicer"

_M = TypeVar("_M", bound=Message)


@dataclass(frozen=True, slots=True)
class UndecodableRequest:
    """Bytes sent as a request message that are not a message of the method's request type."""

    message_type: str
    num_bytes: int

    @property
    def details(self) -> str:
        return f"the request message ({self.num_bytes} bytes) is not a valid {self.message_type}"


def decoded(request: _M | UndecodableRequest) -> _M:
    """The request message; a 400 (INVALID_ARGUMENT) when its bytes did not decode."""
    if isinstance(request, UndecodableRequest):
        raise invalid_request(request.details, param=None)
    return request


def lenient_decoder(message_class: type[Message]) -> Callable[[bytes], Message | UndecodableRequest]:
    """``message_class.FromString`` that returns an ``UndecodableRequest`` where it would raise."""
    message_type = message_class.DESCRIPTOR.full_name

    def decode(data: bytes) -> Message | UndecodableRequest:
        try:
            return message_class.FromString(data)
        except DecodeError:
            return UndecodableRequest(message_type, len(data))

    return decode


def add_servicer(servicer: Any, server: Any) -> None:
    """``add_RayTurnServicer_to_server`` with lenient request decoding (``protos/rayturn.proto``)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=lenient_decoder(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Health": grpc.unary_unary_rpc_method_handler(
            servicer.Health,
            request_deserializer=lenient_decoder(pb.HealthRequest),
            response_serializer=pb.HealthResponse.SerializeToString,
        ),
        "Prewarm": grpc.unary_unary_rpc_method_handler(
            servicer.Prewarm,
            request_deserializer=lenient_decoder(pb.PrewarmRequest),
            response_serializer=pb.PrewarmResponse.SerializeToString,
        ),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            servicer.Tokenize,
            request_deserializer=lenient_decoder(pb.GenerateRequest),
            response_serializer=pb.TokenizeResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
