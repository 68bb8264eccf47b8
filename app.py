"""CosyStream server: ``python app.py`` serves the Gradio studio at / and the HTTP API on one uvicorn server.

The script only: flags, engine building and the app live in ``server/`` (``python app.py --help``).
"""

from server.main import main

if __name__ == "__main__":
    main()
