"""The pieces every operation of the OpenAPI document (``openapi``) shares: its errors, in the shape of its API
(``OpenAIError``: ``{"error": {...}}``; ``AnthropicError``: ``{"type": "error", "error": {...}}``), and the
operation object itself (its answer, parameters, body schema and the rules the schema cannot state).
"""

from __future__ import annotations

from .json_schema import JSON, object_of, string

ERROR_SCHEMAS: JSON = {
    "OpenAIError": object_of(
        {
            "error": object_of(
                {
                    "message": string(),
                    "type": string(),
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
                ("message", "type", "param", "code"),
            )
        },
        ("error",),
    ),
    "AnthropicError": object_of(
        {"type": {"const": "error"}, "error": object_of({"type": string(), "message": string()}, ("type", "message"))},
        ("type", "error"),
    ),
}


def _errors(shape: str) -> JSON:
    content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{shape}"}}}
    return {
        "4XX": {"description": "The request was refused.", "content": content},
        "5XX": {"description": "The server failed; retry.", "content": content},
    }


def operation(
    summary: str, shape: str, body: JSON | None = None, *, streams: bool = False, parameters: list[JSON] | None = None
) -> JSON:
    ok_content: JSON = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        ok_content["text/event-stream"] = {"schema": {"type": "string"}}
    spec: JSON = {"summary": summary, "responses": {"200": {"description": "OK", "content": ok_content}}}
    spec["responses"] |= _errors(shape)
    if parameters is not None:
        spec["parameters"] = parameters
    if body is not None:
        spec["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
        spec["x-rayturn-rules"] = body.pop("x-rayturn-rules", [])
    return spec
