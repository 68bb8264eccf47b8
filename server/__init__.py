"""The single-process server behind ``app.py``: its command line and engine building (``cli``), the web app
that mounts the API and the studio on one uvicorn server (``web``), and the entry point (``main``) that runs
it or starts its Ray Serve replicas."""
