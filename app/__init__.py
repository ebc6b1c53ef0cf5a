"""ragblend's service: the CLI, the HTTP API and the engine that runs a request, over the lower packages
(blend, store, retrieval, common), which app/components.py wires from the settings. Nothing below imports
this package."""
