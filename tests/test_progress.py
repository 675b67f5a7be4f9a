"""Progress on every long stage, and Ctrl-C at once (`dspark_hf.progress`, `dspark_hf.interrupt`).

The log-line mode is read through a pipe (what a log file or CI sees) and the bar through a pseudo-terminal. The Ctrl-C
tests run the real commands on SmolLM2 and a few chatterbot conversations, interrupt each once its `--no-progress`
line shows it is in its main stage, and rerun it to see that it resumes.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from dspark_hf.cache import shard_name
from dspark_hf.progress import duration, log_line, progress, timed
from dspark_hf.vocab import build_draft_vocab, save_draft_vocab

REPO = Path(__file__).resolve().parents[1]
PROGRESS = REPO / "dspark_hf" / "progress.py"
INTERVAL = 0.2  # DSPARK_HF_PROGRESS_INTERVAL of every subprocess here
DEMO = """
import argparse, importlib.util, sys, time
spec = importlib.util.spec_from_file_location("progress", sys.argv.pop(1))  # the module alone: no torch to import
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
add_progress_argument, progress = module.add_progress_argument, module.progress
parser = argparse.ArgumentParser()
add_progress_argument(parser)
args = parser.parse_args()
started = time.perf_counter()
with progress(total=20, desc="demo", unit="tok", enabled=not args.no_progress) as bar:
    for _ in range(20):
        time.sleep(0.05)
        bar.update(1)
print(time.perf_counter() - started)
"""
LINE = re.compile(r"demo: \d+/20 tok \([\d.,]+ tok/s, [\d.]+ s left\)")
LAST = re.compile(r"demo: 20/20 tok in [\d.]+ s \([\d.,]+ tok/s\)")


def _env() -> dict:
    """This checkout first, offline, one thread per process (the suite runs two workers), a short log interval."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "HF_HUB_OFFLINE": "1", "DSPARK_HF_DEBUG": "", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "DSPARK_HF_PROGRESS_INTERVAL": str(INTERVAL)}


# ------------------------------------------------------------------------------------------------ progress lines
def test_a_pipe_gets_a_log_line_per_interval_not_a_bar():
    result = subprocess.run([sys.executable, "-c", DEMO, str(PROGRESS)], env=_env(), capture_output=True, text=True, check=True)
    elapsed = float(result.stdout)
    assert "\r" not in result.stderr and "%|" not in result.stderr, result.stderr
    *lines, last = result.stderr.strip().splitlines()
    assert all(LINE.fullmatch(line) for line in lines) and LAST.fullmatch(last), result.stderr
    assert 2 <= len(lines) <= elapsed / INTERVAL + 1, result.stderr  # steady: one per interval, none skipped


def _on_a_terminal(*flags: str) -> str:
    """DEMO's stderr as a terminal shows it."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 x 100, as a terminal has
    process = subprocess.Popen([sys.executable, "-c", DEMO, str(PROGRESS), *flags], env=_env(), stdout=subprocess.DEVNULL,
                               stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert process.wait(timeout=60) == 0
    return b"".join(chunks).decode()


def test_a_terminal_gets_a_bar_and_no_progress_gets_lines_instead():
    bar = _on_a_terminal()
    assert "demo: 100%|" in bar and "20/20" in bar, bar
    lines = _on_a_terminal("--no-progress").replace("\r\n", "\n")
    assert "%|" not in lines and "\r" not in lines, lines
    assert LINE.search(lines) and LAST.search(lines), lines


def test_a_stage_shorter_than_the_interval_stays_quiet(capsys, monkeypatch):
    monkeypatch.setenv("DSPARK_HF_PROGRESS_INTERVAL", "10")
    for _ in progress(range(3), desc="quick", enabled=False):
        pass
    with timed("quick: loading"):
        pass
    assert capsys.readouterr().err == ""
    with timed("slow: loading", notice_s=0.01):
        time.sleep(0.2)
    assert re.fullmatch(r"slow: loading \.\.\.\nslow: loading \.\.\. done in 0\.\d s\n", capsys.readouterr().err)


def test_log_line_shapes():
    stats = {"n": 1234, "total": None, "unit": "sample", "elapsed": 2.0, "prefix": "vocab", "postfix": "", "initial": 0}
    assert log_line(stats) == "vocab: 1,234 sample (617.0 sample/s)"
    resumed = {**stats, "n": 300, "total": 1000, "initial": 100, "postfix": "loss=0.5"}
    assert log_line(resumed) == "vocab: 300/1,000 sample (100.0 sample/s, 7.0 s left), loss=0.5"
    assert log_line(resumed, done=True) == "vocab: 300/1,000 sample stopped after 2.0 s (100.0 sample/s), loss=0.5"
    assert [duration(s) for s in (0.42, 12, 200, 3900)] == ["0.4 s", "12 s", "3 min 20 s", "1 h 05 min"]


# ------------------------------------------------------------------------------------------------------ Ctrl-C
STUCK = """
import importlib.util, os, signal, sys, threading, time
import torch
spec = importlib.util.spec_from_file_location("interrupt", sys.argv[1])
interrupt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(interrupt)
threading.Timer(0.3, lambda: (print(time.time(), flush=True), os.kill(os.getpid(), signal.SIGINT))).start()
threading.Timer(30, lambda: os._exit(3)).start()
with interrupt.CtrlC("demo: interrupted; rerun"):
    torch.futures.Future().wait()  # a native wait that never returns to Python, so never sees KeyboardInterrupt
"""


def test_ctrl_c_ends_a_command_stuck_in_native_code_within_the_grace():
    result = subprocess.run([sys.executable, "-c", STUCK, str(REPO / "dspark_hf" / "interrupt.py")], env=_env(),
                            capture_output=True, text=True, timeout=60)
    seconds = time.time() - float(result.stdout)
    assert result.returncode == 130 and result.stderr == "demo: interrupted; rerun\n", result.stderr
    assert seconds < 2.0, f"{seconds:.2f} s from Ctrl-C to exit"


class Running:
    """A `dspark-hf` command in a subprocess, its output read line by line as it comes."""

    def __init__(self, args: list[str], cwd: Path):
        self.process = subprocess.Popen([sys.executable, "-m", "dspark_hf.cli", *args], cwd=cwd, env=_env(),
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.err: list[str] = []
        self.out: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                        for stream, lines in ((self.process.stderr, self.err), (self.process.stdout, self.out))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    def saw(self, prefix: str) -> bool:
        return any(line.startswith(prefix) for line in self.err)

    def wait_for(self, ready, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.process.poll() is None, "\n".join(["ended before it could be interrupted:", *self.err[-20:]])
            assert time.monotonic() < deadline, "\n".join(["never got there:", *self.err[-20:]])
            time.sleep(0.05)

    def interrupt(self) -> float:
        """Ctrl-C; the seconds until the process has exited."""
        sent = time.monotonic()
        self.process.send_signal(signal.SIGINT)
        self.process.wait(timeout=60)
        seconds = time.monotonic() - sent
        for reader in self.readers:
            reader.join(timeout=10)
        return seconds


def _assert_stopped_at_once(run: Running, seconds: float, hint: str) -> None:
    """Exit status 130 within 2 s, no traceback, and the resume hint as the last line."""
    err = "\n".join(run.err)
    print(f"{run.process.args[3]}: exited {seconds:.2f} s after Ctrl-C")
    assert run.process.returncode == 130 and "Traceback" not in err, err
    assert run.err[-1].startswith(f"dspark-hf {run.process.args[3]}: interrupted; {hint}"), err
    assert seconds < 2.0, f"{seconds:.2f} s from Ctrl-C to exit"


def _rerun(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "dspark_hf.cli", *args], cwd=cwd, env=_env(), capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _manifest(directory: Path) -> dict:
    path = directory / "manifest.json"
    return json.loads(path.read_text()) if path.is_file() else {"shards": [], "complete": False}


@pytest.mark.slow
def test_ctrl_c_during_capture_exits_at_once_and_the_rerun_keeps_the_finished_shards(tmp_path):
    out = tmp_path / "cache"
    args = ["cache", "--target", "smollm2", "--dataset", "chatterbot", "--limit", "8", "--output", str(out),
            "--shard-size", "2", "--batch-size", "2", "--no-progress"]
    run = Running(args, tmp_path)
    run.wait_for(lambda: run.saw("cache: ") and len(_manifest(out)["shards"]) >= 1)  # a `cache: n/N tok` line
    seconds = run.interrupt()
    _assert_stopped_at_once(run, seconds, "rerun the same command to resume where it stopped")
    kept = [shard["file"] for shard in _manifest(out)["shards"]]
    assert not _manifest(out)["complete"], "the capture finished before Ctrl-C; give it more conversations"
    before = {name: (out / name).stat() for name in kept}
    _rerun(args, tmp_path)
    assert _manifest(out)["complete"] and len(_manifest(out)["shards"]) == 4
    for name, stat in before.items():  # finished shards are never captured again
        assert ((out / name).stat().st_ino, (out / name).stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)


@pytest.mark.slow
def test_ctrl_c_during_regeneration_exits_at_once_and_the_rerun_keeps_the_finished_conversations(tmp_path):
    out = tmp_path / "regenerated.jsonl"
    args = ["regenerate", "--target", "smollm2", "--dataset", "chatterbot", "--limit", "6", "--output", str(out),
            "--max-new-tokens", "8", "--batch-size", "2", "--no-progress"]
    run = Running(args, tmp_path)
    run.wait_for(lambda: run.saw("regenerate: ") and out.is_file() and out.read_bytes().count(b"\n") >= 2)
    seconds = run.interrupt()
    _assert_stopped_at_once(run, seconds, "rerun the same command to resume where it stopped")
    written = out.read_bytes()
    done = written.count(b"\n")
    assert 2 <= done < 6, "the regeneration finished before Ctrl-C; give it more conversations"
    result = _rerun(args, tmp_path)
    assert out.read_bytes().startswith(written)  # the finished conversations are kept as they were
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 6
    assert f"wrote {6 - done} conversations ({done} already done)" in result.stdout


class HangingServer(ThreadingHTTPServer):
    """A chat endpoint on loopback that answers at once, except a conversation asking "slow" until `release` is set."""

    daemon_threads = True

    def __init__(self):
        self.release, self.hanging = threading.Event(), threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if "slow" in payload["messages"][-1]["content"]:
                    server.hanging.set()
                    server.release.wait(60)
                body = json.dumps({"choices": [{"message": {"content": "fine"}}]}).encode()
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.mark.slow
def test_ctrl_c_while_a_server_request_hangs_exits_at_once(tmp_path):
    """The interpreter joins a request's worker thread at exit (up to --request-timeout): Ctrl-C does not wait."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": name, "messages": [{"role": "user", "content": name}]}) + "\n"
                             for name in ("quick", "slow")))
    out, server = tmp_path / "out.jsonl", HangingServer()
    args = ["regenerate", "--target", "served", "--input", str(chats), "--output", str(out), "--server", server.url,
            "--concurrency", "2", "--no-progress"]
    try:
        run = Running(args, tmp_path)
        run.wait_for(lambda: server.hanging.is_set() and out.is_file() and out.read_bytes().count(b"\n") == 1)
        seconds = run.interrupt()
        _assert_stopped_at_once(run, seconds, "rerun the same command to resume where it stopped")
        server.release.set()
        assert "wrote 1 conversations (1 already done)" in _rerun(args, tmp_path).stdout
    finally:
        server.release.set()
        server.shutdown()


@pytest.mark.slow
def test_ctrl_c_during_training_exits_at_once_and_resume_continues(tmp_path):
    vocab = tmp_path / "vocab.safetensors"
    save_draft_vocab(vocab, *build_draft_vocab(torch.arange(49152).flip(0), 1024))  # a small head: light checkpoints
    out = tmp_path / "train"
    args = ["train", "--online", "--target", "smollm2", "--dataset", "chatterbot", "--limit", "8", "--max-length", "64",
            "--output-dir", str(out), "--draft-vocab", str(vocab), "--num-draft-layers", "1", "--block-size", "4",
            "--markov-rank", "0", "--max-anchors", "4", "--max-steps", "6", "--save-steps", "2", "--save-total-limit",
            "1", "--report-to", "none", "--no-progress"]
    run = Running(args, tmp_path)
    run.wait_for(lambda: run.saw("train: ") and any((out / "checkpoints").glob("checkpoint-*")))
    seconds = run.interrupt()
    _assert_stopped_at_once(run, seconds, "rerun the same command with --resume")
    assert not (out / "drafter").exists(), "the training finished before Ctrl-C; give it more steps"
    result = _rerun([*args, "--resume"], tmp_path)
    assert re.search(r"resumed from \S+checkpoint-([24]) at step \1", result.stdout), result.stdout
    summary = json.loads(result.stdout[re.search(r"^\{$", result.stdout, re.M).start():])
    assert summary["finished"] and summary["step"] == 6 and (out / "drafter").is_dir()
