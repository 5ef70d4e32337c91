"""Benchmarks: anything that measures, apart from the tests. Each module is a script run by path
(``.venv/bin/python benchmarks/NAME.py``, see README.md) and importable as ``benchmarks.NAME``;
``harness`` holds what the server-driving scripts share, ``load`` the load generator."""
