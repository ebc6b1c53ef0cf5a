"""Serving: the service's lifecycle (loading, health, shutdown), the model thread (the scheduler that runs every
request's model work), the worker lanes and the metrics. It runs the engine (app.engine) and knows nothing of HTTP:
app.api turns its refusals into responses."""
