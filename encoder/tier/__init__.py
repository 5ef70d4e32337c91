"""The encoder tier: ``vlmserve encoder`` (server.py, workers.py) and the engine's client (client.py)."""
