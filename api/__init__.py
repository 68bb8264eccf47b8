"""OpenAI-compatible HTTP API over the resident engine: speech, saved voices, health, readiness, metrics.

``api.app.mount_api(app, engine, limits, api_key)`` adds every route to an existing FastAPI app (the one the
Gradio UI is mounted on). Nothing heavy is imported here.
"""
