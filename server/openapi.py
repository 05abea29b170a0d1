"""The OpenAPI schema the server publishes at /openapi.json."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from eagle_serve.server.protocol import ChatRequest, CompletionRequest

if TYPE_CHECKING:
    from eagle_serve.server.app import ServerState


def _bound_ints(props: dict, max_token_id: int, max_tokens: int) -> None:
    """This model's real bounds in the schema: token ids below the vocabulary size, token
    counts below the context length."""
    def walk(node, key):
        if isinstance(node, dict):
            if node.get("type") == "integer" and key in ("prompt", "max_tokens", "max_completion_tokens", "min_tokens"):
                node["maximum"] = max_token_id if key == "prompt" else max_tokens
            for v in node.values():
                walk(v, key)
        elif isinstance(node, list):
            for v in node:
                walk(v, key)
    for key, value in props.items():
        walk(value, key)


def openapi_schema(app: FastAPI, state: ServerState) -> dict:
    """The schema clients (and the fuzz tests) see: the request bodies are the pydantic models
    the handlers validate against, and every status a route can answer is listed."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    comps["ErrorResponse"] = {
        "type": "object", "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
    err = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    descriptions = {"400": "invalid request", "401": "missing or wrong API key", "404": "unknown model",
                    "408": "the request ran past the server's request timeout", "413": "request body too large",
                    "503": "server busy (Retry-After) or engine down"}
    errors = {code: {"description": d, **err} for code, d in descriptions.items()}
    for path, model in (("/v1/chat/completions", ChatRequest), ("/v1/completions", CompletionRequest)):
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        comps.update(js.pop("$defs", {}))
        js["properties"]["model"] = {"type": "string", "enum": [state.model_name], "title": "Model",
                                     "description": "the one model this server serves (GET /v1/models)"}
        _bound_ints(js["properties"], state.llm.loop.vocab_size - 1, state.llm.max_model_len - 1)
        comps[model.__name__] = js
        op = schema["paths"][path]["post"]
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        op["responses"] = {"200": {"description": "the completion (JSON), or its chunks as server-sent events",
                                   "content": {"application/json": {"schema": {"type": "object"}},
                                               "text/event-stream": {"schema": {
                                                   "type": "object", "required": ["data"],
                                                   "properties": {"data": {"type": "string"},
                                                                  "event": {"type": "string"}}}}}},
                           **errors}
    schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {
        "text/plain": {"schema": {"type": "string", "description": "Prometheus text exposition format 0.0.4"}}}
    models_op = schema["paths"]["/v1/models"]["get"]
    models_op["responses"]["401"] = errors["401"]
    schema["paths"]["/health"]["get"]["responses"]["503"] = {"description": "not loaded, stalled or stopped",
                                                              "content": {"application/json": {"schema": {"type": "object"}}}}
    if state.api_key:
        comps_root = schema["components"]
        comps_root["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, ops in schema["paths"].items():
            if path.startswith("/v1/"):
                for op in ops.values():
                    op["security"] = [{"bearer": []}]
    app.openapi_schema = schema
    return schema
