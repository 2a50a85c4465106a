"""The HTTP adapter: an OpenAI-compatible API over the stream layer (see app.py), the engine
host that serves one request at a time (host.py), request models (schemas.py), Prometheus
metrics (metrics.py) and listening/stopping (run.py). `specrun serve` (cli/serve.py) wires
them together; nothing here imports the CLI."""
