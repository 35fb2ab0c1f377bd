"""The OpenAI-compatible HTTP server and the chat page, over the inference engine.

``app.py`` has the routes, ``protocol.py`` the request bodies, errors and log-probability
formats, ``worker.py`` the engine's thread, ``server.py`` uvicorn on a socket, and
``static/`` the chat page (plain HTML, CSS and JavaScript, no build step).
"""
