"""The `ragblend` command line (main.py parses, commands.py runs): ingest, serve, ask, compare (and its answer
metrics), store, and `python -m app.cli.prepare`. The top layer: it may import everything in app."""
