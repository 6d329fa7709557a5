"""The OpenAI-compatible HTTP server: `build_app(engine, settings)` and `serve(...)` in api_server."""
