"""`dspark-hf regenerate --server URL`: the turns go to an OpenAI-compatible chat endpoint (vLLM, SGLang, TGI).

A loopback stand-in server (http.server on 127.0.0.1, port 0, a thread) answers `POST /v1/chat/completions`, either
with the tiny target's own greedy reply (chat template applied server-side, as vLLM does) or with a deterministic
echo; it can fail requests, send malformed JSON, or stop mid-run. Our client and resume code are not mocked.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from conftest import make_tiny_target
from dspark_hf.cli import main
from dspark_hf.data import read_jsonl
from dspark_hf.regenerate import regenerate_conversations, regenerate_through_server
from dspark_hf.serving import ChatServer, chat_completions_url


def _chats(count: int, turns: int = 2) -> list[dict]:
    conversations = []
    for i in range(count):
        messages = [{"role": "system", "content": "Be brief."}]
        for turn in range(turns):
            messages += [{"role": "user", "content": f"Question {i}.{turn}: what is the weather like?"},
                         {"role": "assistant", "content": "a human answer"}]
        conversations.append({"id": f"c{i}", "messages": messages})
    return conversations


def echo(messages: list[dict]) -> str:
    """The stand-in's default reply: names the last user turn and how much history came with it."""
    return f"echo {len(messages)}: {messages[-1]['content']}"


def expected_echo_output(conversations: list[dict]) -> list[dict]:
    records = []
    for conversation in conversations:
        messages = []
        for message in conversation["messages"]:
            if message["role"] == "assistant":
                continue
            messages.append(message)
            if message["role"] == "user":
                messages.append({"role": "assistant", "content": echo(messages)})
        records.append({"id": conversation["id"], "messages": messages})
    return records


class StandIn(ThreadingHTTPServer):
    """Loopback-only chat server. `reply(messages, payload) -> str`; `fail_first` requests get a 500 (then it
    works); `malformed` answers every request with broken JSON; after `stop_after` answered requests it closes."""

    daemon_threads = True

    def __init__(self, reply=None, fail_first: int = 0, malformed: bool = False, stop_after: int | None = None):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.reply = reply or (lambda messages, payload: echo(messages))
        self.fail_first, self.malformed, self.stop_after = fail_first, malformed, stop_after
        self.lock = threading.Lock()
        self.requests: list[dict] = []
        self.answered = 0
        self.stopped = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        """Stop serving and close the socket, so later requests are refused (a killed server)."""
        if not self.stopped.is_set():
            self.stopped.set()
            threading.Thread(target=lambda: (self.shutdown(), self.server_close()), daemon=True).start()


class _Handler(BaseHTTPRequestHandler):
    server: StandIn

    def log_message(self, *args):
        pass

    def _send(self, status: int, data: bytes):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        with server.lock:
            if server.stopped.is_set():
                self.close_connection = True  # a dead server answers nothing
                return
            server.requests.append(payload)
            if self.path != "/v1/chat/completions":
                return self._send(404, b'{"error": "not found"}')
            if len(server.requests) <= server.fail_first:
                return self._send(500, b'{"error": "overloaded"}')
            if server.malformed:
                return self._send(200, b'{"choices": [{"message": ')
            content = server.reply(payload["messages"], payload)
            server.answered += 1
            if server.stop_after is not None and server.answered > server.stop_after:
                server.stop()
                self.close_connection = True
                return
        body = {"id": "x", "object": "chat.completion", "model": payload["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": None if content is None else " " + content + "\n"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}
        self._send(200, json.dumps(body).encode())


def _serve(server: StandIn):
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def stand_in():
    """Start stand-in servers on demand; all are stopped and closed at the end."""
    started = []

    def start(**kwargs) -> StandIn:
        server = StandIn(**kwargs)
        started.append((server, _serve(server)))
        return server

    yield start
    for server, thread in started:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _client(server: StandIn | str, **kwargs) -> ChatServer:
    url = server if isinstance(server, str) else server.url
    return ChatServer(url, kwargs.pop("model", "tiny-target"), backoff=0.01, max_backoff=0.05, timeout=10, **kwargs)


def test_server_urls_are_normalised():
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert chat_completions_url(url) == "http://h:8000/v1/chat/completions"
    with pytest.raises(ValueError, match="not an http"):
        chat_completions_url("localhost:8000")


def test_a_server_run_writes_the_local_format_in_input_order(stand_in, tmp_path):
    server = stand_in()
    convs = _chats(7)
    out = tmp_path / "regen.jsonl"
    client = _client(server, model="org/target")
    assert regenerate_through_server(client, convs, out, max_new_tokens=12, concurrency=3, progress=False) == 7
    assert read_jsonl(out) == expected_echo_output(convs)  # reply stripped, as the local path strips
    assert len(server.requests) == 14
    first = server.requests[0]
    assert first["model"] == "org/target" and first["max_tokens"] == 12
    assert first["temperature"] == 0 and first["top_p"] == 1.0 and "seed" not in first  # greedy
    assert all(m["role"] != "assistant" or m["content"].startswith("echo") for r in server.requests for m in r["messages"])
    assert regenerate_through_server(client, convs, out, concurrency=3, progress=False) == 0  # all done
    assert len(server.requests) == 14


def test_sampling_sends_a_seed_per_turn_that_a_rerun_repeats(stand_in, tmp_path):
    server = stand_in()
    convs = _chats(2)
    for name in ("a", "b"):
        regenerate_through_server(_client(server), convs, tmp_path / f"{name}.jsonl", temperature=0.7, top_p=0.9,
                                  seed=3, concurrency=1, progress=False)
    seeds = [r["seed"] for r in server.requests]
    assert seeds[:4] == seeds[4:] and len(set(seeds[:4])) == 4
    assert all(r["temperature"] == 0.7 and r["top_p"] == 0.9 for r in server.requests)


def test_the_server_path_writes_what_the_local_path_writes(stand_in, smollm2_tokenizer, tmp_path):
    """A stand-in that applies the chat template and generates greedily with the same target (as vLLM does):
    the file equals the local path's, byte for byte."""
    tokenizer = smollm2_tokenizer
    tiny = make_tiny_target("llama", vocab_size=len(tokenizer), layers=2)

    @torch.inference_mode()
    def target_reply(messages, payload):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = tiny.generate(**ids, max_new_tokens=payload["max_tokens"], do_sample=payload["temperature"] > 0, top_k=None)
        return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)

    server = stand_in(reply=target_reply)
    convs = _chats(3)
    local, remote = tmp_path / "local.jsonl", tmp_path / "remote.jsonl"
    regenerate_conversations(tiny, tokenizer, convs, local, max_new_tokens=5, batch_size=1, progress=False)
    regenerate_through_server(_client(server), convs, remote, max_new_tokens=5, concurrency=2, progress=False)
    assert remote.read_bytes() == local.read_bytes()
    assert any(m["content"] for r in read_jsonl(local) for m in r["messages"] if m["role"] == "assistant")


def test_the_server_path_bounds_the_history_like_the_local_path(stand_in, smollm2_tokenizer, tmp_path):
    server = stand_in()
    convs = _chats(1, turns=12)
    regenerate_through_server(_client(server), convs, tmp_path / "x.jsonl", max_new_tokens=8, concurrency=1,
                              tokenizer=smollm2_tokenizer, max_length=120, progress=False)
    sizes = [len(r["messages"]) for r in server.requests]
    assert sizes[0] == 2 and max(sizes) < 2 + 2 * 12 - 1  # later turns dropped the oldest ones
    assert all(r["messages"][0]["role"] == "system" and r["messages"][1]["role"] == "user" for r in server.requests)
    for request in server.requests:
        ids = smollm2_tokenizer.apply_chat_template(request["messages"], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        assert len(ids) <= 120 - 8


def test_failed_requests_are_retried_with_backoff(stand_in, tmp_path):
    server = stand_in(fail_first=3)
    convs = _chats(4)
    out = tmp_path / "regen.jsonl"
    assert regenerate_through_server(_client(server, retries=3), convs, out, concurrency=2, progress=False) == 4
    assert read_jsonl(out) == expected_echo_output(convs)
    assert len(server.requests) == 8 + 3


def test_a_server_that_keeps_failing_is_one_clear_error(stand_in, tmp_path):
    server = stand_in(fail_first=100)
    with pytest.raises(ConnectionError, match=r"failed 3 times in a row \(last: HTTP 500\).*rerun the same command"):
        regenerate_through_server(_client(server, retries=2), _chats(2), tmp_path / "x.jsonl", concurrency=1, progress=False)
    assert len(server.requests) == 3  # bounded, then stop: the second conversation was never sent


def test_malformed_json_is_one_clear_line(stand_in, tmp_path, capsys):
    server = stand_in(malformed=True)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in _chats(2)))
    out = tmp_path / "regen.jsonl"
    code = main(["regenerate", "--target", "tiny", "--input", str(data), "--output", str(out), "--server", server.url,
                 "--retries", "0", "--concurrency", "1", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1
    assert "malformed JSON" in err[0] and server.url in err[0] and "OpenAI-compatible" in err[0]
    assert out.read_text() == ""


def test_a_reply_without_content_is_an_error_not_a_crash(stand_in, tmp_path):
    server = stand_in(reply=lambda messages, payload: None)  # json null content
    with pytest.raises(ValueError, match=r"without choices\[0\]\.message\.content"):
        regenerate_through_server(_client(server), _chats(1), tmp_path / "x.jsonl", concurrency=1, progress=False)


def test_no_server_listening_is_one_clear_line(tmp_path, capsys):
    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(_chats(1)[0]) + "\n")
    code = main(["regenerate", "--target", "org/big-target", "--input", str(data), "--output", str(tmp_path / "o.jsonl"),
                 "--server", url, "--retries", "0", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1
    assert url in err[0] and "ConnectError" in err[0] and "vllm serve org/big-target" in err[0]


def test_a_server_killed_mid_run_leaves_whole_lines_and_a_rerun_finishes(stand_in, tmp_path):
    convs = _chats(8)
    out = tmp_path / "regen.jsonl"
    # 8 answers: the first conversation's 2 turns are among them however its thread is scheduled (at most the 3
    # others in flight, 6 answers, finish first), so a line is written; 16 turns in all, so the kill comes mid-run
    dying = stand_in(stop_after=8)
    with pytest.raises(ConnectionError, match="rerun the same command to resume"):
        regenerate_through_server(_client(dying, retries=2), convs, out, concurrency=2, progress=False)
    raw = out.read_bytes()
    assert raw == b"" or raw.endswith(b"\n")
    written = read_jsonl(out) if raw else []
    assert 1 <= len(written) < 8
    assert written == expected_echo_output(convs)[: len(written)]  # whole lines, in order
    fresh = stand_in()
    assert regenerate_through_server(_client(fresh), convs, out, concurrency=2, progress=False) == 8 - len(written)
    assert read_jsonl(out) == expected_echo_output(convs)
    redone = {r["messages"][1]["content"].split(":")[0] for r in fresh.requests}
    assert redone == {f"Question {i}.0" for i in range(len(written), 8)}  # nothing written was asked again
