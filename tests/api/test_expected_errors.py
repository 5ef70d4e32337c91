"""Refusals the server expects (admission control's 503) are answers, not crashes:
the app does not re-raise them past its error handlers, where uvicorn would log a traceback and close the
client's keep-alive connection for every refused request."""

from __future__ import annotations

from fastapi.testclient import TestClient

from api.config import ServerArgs
from api.server import create_app
from lm_engine.config import EngineConfig

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}


def test_a_503_from_admission_control_is_answered_not_reraised(tiny_ckpt):
    args = ServerArgs(engine=EngineConfig(model=str(tiny_ckpt), num_kv_blocks=64, max_queued_requests=0))
    # NOTE: raise_server_exceptions: anything the app lets escape fails the request here.
    with TestClient(create_app(args), raise_server_exceptions=True) as client:
        resp = client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "overloaded"
        assert resp.headers["Retry-After"]
