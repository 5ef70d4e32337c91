"""At serve time the vision tower is ours: a fresh process that builds the server and answers an image request
has imported no transformers modeling module (transformers' towers would cap our speed at its own)."""

from __future__ import annotations

from tests.support import run_fresh

SERVE_ONE_REQUEST = r"""
import base64, json, re, sys
from fastapi.testclient import TestClient
from api.config import ServerArgs
from api.server import create_app
from lm_engine.config import EngineConfig
from tests.support import make_image

args = ServerArgs(engine=EngineConfig(model=sys.argv[1], num_kv_blocks=64))
url = "data:image/png;base64," + base64.b64encode(make_image(120, 90, 1)).decode()
body = {
    "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]}],
    "max_tokens": 4, "temperature": 0,
}
with TestClient(create_app(args)) as client:
    resp = client.post("/v1/chat/completions", json=body)
    metrics = client.get("/metrics").text
patches = [float(l.split()[-1]) for l in metrics.splitlines() if l.startswith("vlmserve_encoder_patches")]
modeling = sorted(m for m in sys.modules if re.fullmatch(r"transformers\.models\.[^.]+\.modeling_[^.]+", m))
heavy = sorted(m for m in ("torchvision", "torch._dynamo") if m in sys.modules)
print(json.dumps({"status": resp.status_code, "body": resp.text, "patches": patches, "modeling": modeling,
                  "heavy": heavy}))
"""


def test_serving_imports_no_transformers_modeling_module(tiny_ckpt):
    report = run_fresh(SERVE_ONE_REQUEST, str(tiny_ckpt))
    assert report["status"] == 200, report["body"]
    assert report["patches"] and report["patches"][0] > 0  # the image really went through the tower
    assert report["modeling"] == []
    # nor torchvision (its import pulls in torch._dynamo: seconds of start-up in every serving process)
    assert report["heavy"] == []


def test_the_command_module_is_light():
    """Worker processes re-import the main module (``python -m api.cli``, or the ``vlmserve`` script that
    imports it) before they run: api.cli must not import torch at module level, or every preprocess and
    encoder worker pays for it again."""
    code = "import json, sys, api.cli; print(json.dumps([m for m in ('torch', 'numpy', 'transformers') if m in sys.modules]))"
    assert run_fresh(code, timeout=60) == []
