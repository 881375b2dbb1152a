"""OpenAI-compatible HTTP API of the router, one module per concern.

  protocol   request bodies as strict pydantic models (also the OpenAPI schema)
  errors     OpenAI's error shape and the app's error handlers
  body       reading and parsing a request body (415 / 413 / 400)
  convert    request model -> `router.request.RouterRequest` (the core's request type)
  responses  the core's GenerateResponses -> OpenAI JSON bodies and SSE chunks
  routes     the endpoints, client-disconnect handling, and `mount` onto the FastAPI app
"""
