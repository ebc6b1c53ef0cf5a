"""The HTTP API: routes (ragblend's own, OpenAI's and Anthropic's dialects, documents, cache, health, the page),
their request/response schemas (schemas/), errors and middleware. It asks the service (app.serving) for work and
reads the engine's types (app.engine); nothing below imports it."""
