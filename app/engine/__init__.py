"""The request engine: a request as retrieve → plan → prefill → decode → store (rag_engine.py), the planner that
decides once where each span's KV comes from, the KV of heads and passages, the request and result types, chat
messages, tool calls, the loading controller's glue, prompt-cache leases, explain, usage counts and ingest.
It is handed its parts (app.components builds them) and imports neither app.serving nor app.api."""
