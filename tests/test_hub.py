"""Hub: the generated model card, and the real `push_to_hub` against an offline stand-in for the Hub API.

The stand-in is a loopback HTTP server implementing the endpoints huggingface_hub 2.4 calls for a push (read from
`hf_api.py` / `_commit_api.py`): `POST /api/repos/create`, `HEAD|GET /{repo}/resolve/{rev}/{file}` (the existing
card, 404 here), `POST /api/validate-yaml`, `POST /api/models/{repo}/preupload/{rev}` (answers "regular", so files
travel inline and no LFS/Xet storage is needed) and `POST /api/models/{repo}/commit/{rev}` (NDJSON, base64 files).
Our code is not mocked: the push runs in a fresh interpreter pointed at the server with `HF_ENDPOINT`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModel

from conftest import make_drafter, make_tiny_target
from dspark_hf.presets import preset_config
from dspark_hf import DSparkConfig, DSparkContextCache
from dspark_hf.hub import build_model_card

REPO_ROOT = Path(__file__).resolve().parent.parent


class FakeHub(ThreadingHTTPServer):
    """Loopback-only Hub stand-in that stores committed files under `storage/{repo_id}` and logs every request."""

    daemon_threads = True

    def __init__(self, storage: Path):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.storage = storage
        self.requests: list[tuple[str, str]] = []
        self.commits: list[dict] = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _reply(self, status: int, body: dict | None = None, headers: dict | None = None):
        data = json.dumps(body or {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        self.server.requests.append((self.command, self.path))
        # Only the existing-card lookup of a fresh repo reaches here: there is none yet.
        self._reply(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})

    def do_POST(self):
        path = self.path.split("?")[0]
        self.server.requests.append(("POST", path))
        body = self._body()
        if path == "/api/repos/create":
            payload = json.loads(body)
            repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
            return self._reply(200, {"url": f"{self.server.endpoint}/{repo_id}", "name": repo_id, "id": repo_id})
        if path == "/api/validate-yaml":
            return self._reply(200, {"errors": [], "warnings": []})
        if path.startswith("/api/models/") and "/preupload/" in path:
            files = json.loads(body)["files"]
            return self._reply(200, {"files": [
                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None} for f in files]})
        if path.startswith("/api/models/") and "/commit/" in path:
            repo_id = path[len("/api/models/"):].split("/commit/")[0]
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
            header = next(item["value"] for item in lines if item["key"] == "header")
            files = [item["value"] for item in lines if item["key"] == "file"]
            for file in files:
                target = self.server.storage / repo_id / file["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(base64.b64decode(file["content"]))
            oid = hashlib.sha1(body).hexdigest()
            self.server.commits.append({"summary": header["summary"], "files": sorted(f["path"] for f in files),
                                        "other": [item["key"] for item in lines if item["key"] not in ("header", "file")]})
            return self._reply(200, {"commitUrl": f"{self.server.endpoint}/{repo_id}/commit/{oid}", "commitOid": oid})
        self._reply(404, {"error": f"fake hub: unexpected endpoint {path}"})


@pytest.fixture
def fake_hub(tmp_path):
    server = FakeHub(tmp_path / "hub")
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    stopper = threading.Timer(240, server.shutdown)  # never outlives a stuck test
    stopper.start()
    try:
        yield server
    finally:
        stopper.cancel()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def drafts(drafter, aux, anchors=(3, 17, 50)):
    cache = drafter.extend_context(DSparkContextCache(), aux.to(drafter.fc.weight.dtype))
    return [drafter.draft_block(cache, a) for a in anchors]


def test_model_card_states_what_the_drafter_needs():
    config = preset_config("kimi-k2.6")
    card = build_model_card(
        config,
        repo_id="novita/kimi-k2.6-dspark",
        training_data=["regenerated ShareGPT (on-policy)"],
        training_command="accelerate launch -m dspark_hf.cli train --config kimi.yaml",
        tau={"offline teacher-forced": {"τ": 3.97, "acceptance": [0.816, 0.720, 0.652, 0.598, 0.553, 0.512, 0.474]},
             "gsm8k (vLLM)": {"τ": 4.45}},
        speed={"greedy": {"tokens/s": 41.2, "speedup": 2.6}},
        machine="8× H200, vLLM 0.12",
    )
    reparsed = ModelCard(card.content)
    assert reparsed.data.library_name == "transformers"
    assert reparsed.data.tags == ["speculative-decoding", "dspark"]
    assert reparsed.data.base_model == "moonshotai/Kimi-K2.6"
    text = card.content
    for fact in ("[1, 29, 57]", "target_layer_ids [0, 28, 56]", "8 (7 drafts per block, sample_from_anchor = false)",
                 "32000 of 163840", "vanilla, rank 256", "on, with Markov features", "3.97",
                 "0.816 / 0.72 / 0.652", "4.45", "41.2", "8× H200", "accelerate launch", "regenerated ShareGPT",
                 "trust_remote_code=True", '"method": "dspark"'):
        assert fact in text, fact


@pytest.mark.slow
def test_push_to_hub_uploads_weights_code_card_and_generation_config(fake_hub, tmp_path):
    target = make_tiny_target("qwen3")
    drafter = make_drafter(target, draft_vocab_size=64)
    drafter.generation_config.num_assistant_tokens = 2
    drafter.save_pretrained(tmp_path / "local")

    script = textwrap.dedent(
        """
        import sys
        from dspark_hf import DSparkForDrafting
        from dspark_hf.hub import push_drafter_to_hub

        drafter = DSparkForDrafting.from_pretrained(sys.argv[1])
        commit = push_drafter_to_hub(drafter, "tester/tiny-dspark", target="tiny/qwen3",
                                     tau={"held-out": {"τ": 2.5}}, machine="2 CPU cores")
        print("COMMIT", commit.oid)
        """
    )
    env = {
        **os.environ,
        "HF_ENDPOINT": fake_hub.endpoint,
        "HF_HUB_OFFLINE": "0",
        "HF_TOKEN": "hf_fake_token_for_the_local_stand_in",
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "NO_PROXY": "127.0.0.1",
        "no_proxy": "127.0.0.1",
    }
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "local")], env=env, cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "COMMIT" in result.stdout

    # What the real client asked for: create, card lookup, YAML check, preupload, two commits; nothing else.
    posts = [p for m, p in fake_hub.requests if m == "POST"]
    assert posts[0] == "/api/repos/create"
    assert sum("/commit/" in p for p in posts) == 2 and "/api/validate-yaml" in posts
    assert all("/preupload/" in p or "/commit/" in p or p in ("/api/repos/create", "/api/validate-yaml") for p in posts)
    assert any("/resolve/main/README.md" in p for m, p in fake_hub.requests if m in ("HEAD", "GET"))
    assert all(c["other"] == [] for c in fake_hub.commits)  # every file went inline: no LFS pointers

    pushed = fake_hub.storage / "tester" / "tiny-dspark"
    assert {"model.safetensors", "config.json", "configuration_dspark.py", "modeling_dspark.py",
            "generation_config.json"} <= set(fake_hub.commits[0]["files"])
    assert fake_hub.commits[1]["files"] == ["README.md", "generation_config.json"]
    card = ModelCard((pushed / "README.md").read_text())
    assert card.data.base_model == "tiny/qwen3" and "dspark" in card.data.tags and "2 CPU cores" in card.content
    assert json.loads((pushed / "generation_config.json").read_text())["num_assistant_tokens"] == 2
    assert (pushed / "modeling_dspark.py").read_text() == (REPO_ROOT / "modeling_dspark.py").read_text()

    # The pushed files load with trust_remote_code and draft exactly what the local drafter drafts.
    reloaded = AutoModel.from_pretrained(pushed, trust_remote_code=True).eval()
    assert type(reloaded).__name__ == "DSparkForDrafting"
    assert reloaded.generation_config.num_assistant_tokens == 2
    local = type(drafter).from_pretrained(tmp_path / "local").eval()
    aux = torch.randn(1, 9, 3 * 64, generator=torch.Generator().manual_seed(0))
    for a, b in zip(drafts(local, aux), drafts(reloaded, aux)):
        assert torch.equal(a.token_ids, b.token_ids)
        torch.testing.assert_close(a.draft_logits, b.draft_logits, rtol=0, atol=1e-6)
