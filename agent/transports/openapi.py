"""The agent's HTTP API as an OpenAPI 3.0 document (served at ``GET /openapi.json``).

The Open Inference Protocol (KServe v2) endpoints the agent implements, with the JSON tensor schema of
an infer request, plus the image endpoint and the metrics. The image endpoint answers a single model with a KServe
v2 response (``InferResponse``) and a pipeline (manifest version 7, agent/core/pipeline.py's ``image_answer``) with its
boxes and what it read in each (``PipelineImageAnswer``): its 200 is one of the two. Clients and fuzzers (the tests run
schemathesis against it) read it; the server does not validate requests against it: the handlers do,
with messages that name the problem.
"""

from __future__ import annotations

from typing import Any

__all__ = ["openapi"]

_ERROR = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}
_DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
              "FP64", "BYTES"]


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    what = {400: "bad request (the message names the problem)", 404: "no such model or version",
            413: "body over the size limit", 415: "not an image", 429: "queue full (Retry-After)",
            503: "not ready, model being replaced, or waited too long in the queue"}
    return {str(c): _json({"$ref": "#/components/schemas/Error"}, what[c]) for c in codes}


def openapi(version: str, max_body_bytes: int, models: dict[str, str] | None = None) -> dict[str, Any]:
    """``models``: name -> version of the models being served, given as the path parameters' examples."""
    first = sorted((models or {}).items())[:1]
    name: dict[str, Any] = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
    ver: dict[str, Any] = {"name": "version", "in": "path", "required": True, "schema": {"type": "string"}}
    if first:
        name["example"], ver["example"] = first[0]
    model_ops: dict[str, Any] = {}
    for base, params in (("/v2/models/{name}", [name]), ("/v2/models/{name}/versions/{version}", [name, ver])):
        model_ops[base] = {"get": {"summary": "model metadata", "parameters": params,
                                   "responses": {"200": _json({"type": "object"}, "inputs, outputs, versions"),
                                                 **_errors(404)}}}
        model_ops[f"{base}/ready"] = {"get": {"summary": "model readiness", "parameters": params,
                                              "responses": {"200": {"description": "ready"}, **_errors(404)}}}
        model_ops[f"{base}/config"] = {"get": {"summary": "model configuration (Triton's layout)",
                                               "parameters": params,
                                               "responses": {"200": _json({"type": "object"}, "config"),
                                                             **_errors(404)}}}
        model_ops[f"{base}/stats"] = {"get": {"summary": "inference statistics", "parameters": params,
                                              "responses": {"200": _json({"type": "object"}, "statistics"),
                                                            **_errors(404)}}}
        model_ops[f"{base}/infer"] = {"post": {
            "summary": "inference (JSON tensors, or the binary tensor data extension with "
                       "Inference-Header-Content-Length)",
            "parameters": params,
            "requestBody": {"required": True, "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/InferRequest"}},
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
            "responses": {"200": _json({"type": "object"}, "outputs"), **_errors(400, 404, 413, 429, 503)}}}
        model_ops[f"{base}/infer/image"] = {"post": {
            "summary": "inference on one JPEG or PNG image, preprocessed as the bundle records",
            "parameters": params,
            "requestBody": {"required": True, "content": {
                "image/jpeg": {"schema": {"type": "string", "format": "binary"}},
                "image/png": {"schema": {"type": "string", "format": "binary"}}}},
            "responses": {"200": _json({"oneOf": [{"$ref": "#/components/schemas/InferResponse"},
                                                  {"$ref": "#/components/schemas/PipelineImageAnswer"}]},
                                       "a single model's outputs (KServe v2 response), or a pipeline's boxes and "
                                       "what it read in each"),
                          **_errors(400, 404, 413, 415, 429, 503)}}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "edgefleet agent (Open Inference Protocol / KServe v2)", "version": version,
                 "description": f"Bodies above {max_body_bytes} bytes get 413. Errors are JSON {{\"error\": ...}}."},
        "paths": {
            "/v2/health/live": {"get": {"summary": "liveness", "responses": {"200": {"description": "live"}}}},
            "/v2/health/ready": {"get": {"summary": "readiness (a model is loaded)",
                                         "responses": {"200": {"description": "ready"}, **_errors(503)}}},
            "/v2": {"get": {"summary": "server metadata", "responses": {"200": _json({"type": "object"}, "meta")}}},
            "/v2/models/stats": {"get": {"summary": "statistics of every model",
                                         "responses": {"200": _json({"type": "object"}, "statistics")}}},
            "/v2/repository/index": {"post": {
                "summary": "models on disk and their state",
                "requestBody": {"required": False, "content": {"application/json": {"schema": {
                    "type": "object", "properties": {"ready": {"type": "boolean"}}}}}},
                "responses": {"200": _json({"type": "array", "items": {"type": "object"}}, "index"),
                              **_errors(400, 413)}}},
            **model_ops,
            "/metrics": {"get": {"summary": "Prometheus metrics",
                                 "responses": {"200": {"description": "text exposition format",
                                                       "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/metrics/summary": {"get": {"summary": "a JSON summary of the metrics",
                                         "responses": {"200": _json({"type": "object"}, "summary")}}},
        },
        "components": {"schemas": {
            "Error": _ERROR,
            "Tensor": {"type": "object", "required": ["name", "shape", "datatype"], "properties": {
                "name": {"type": "string"}, "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                "datatype": {"type": "string", "enum": _DATATYPES}, "data": {"type": "array"},
                "parameters": {"type": "object"}}},
            "InferRequest": {"type": "object", "required": ["inputs"], "properties": {
                "id": {"type": "string"},
                "inputs": {"type": "array", "items": {"$ref": "#/components/schemas/Tensor"}},
                "outputs": {"type": "array", "items": {"type": "object", "properties": {
                    "name": {"type": "string"}, "parameters": {"type": "object"}}}},
                "parameters": {"type": "object"}}},
            "InferResponse": {"type": "object", "required": ["model_name", "outputs"], "properties": {
                "model_name": {"type": "string"}, "model_version": {"type": "string"}, "id": {"type": "string"},
                "parameters": {"type": "object"},
                "outputs": {"type": "array", "items": {"$ref": "#/components/schemas/Tensor"}}}},
            # agent.core.pipeline.image_answer: one image through a detect-then-read pipeline
            "PipelineImageAnswer": {
                "type": "object", "required": ["model_name", "model_version", "count", "boxes", "scores"],
                "description": "A pipeline's answer for one image: its boxes (x0, y0, x1, y1 in the pipeline "
                               "input's pixels, in reading order) with their scores, and what was read in each box: "
                               "texts and text_scores (a CTC reader), or classes and class_scores (top-k, best "
                               "first); every list holds count items.",
                "properties": {
                    "model_name": {"type": "string"}, "model_version": {"type": "string"},
                    "count": {"type": "integer", "minimum": 0},
                    "boxes": {"type": "array", "items": {"type": "array", "items": {"type": "number"},
                                                         "minItems": 4, "maxItems": 4}},
                    "scores": {"type": "array", "items": {"type": "number"}},
                    "texts": {"type": "array", "items": {"type": "string"}},
                    "text_scores": {"type": "array", "items": {"type": "number"}},
                    "classes": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
                    "class_scores": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}},
                "oneOf": [{"required": ["texts", "text_scores"]}, {"required": ["classes", "class_scores"]}]},
        }},
    }
