"""`llmctl`, in-process (click's runner) and as a real process, against the scripted fake
daemon (fake_daemon.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from click.testing import CliRunner

from llmd_client import SamplingParams
from llmd_client.llmctl import cli
from llmd_client.protocol import Submit

from fake_daemon import LLMCTL, METRICS_TEXT, client, daemon, short_dir  # noqa: F401


# -- llmctl in-process ----------------------------------------------------------------------------

def invoke(daemon, *args, input=None):
    return CliRunner().invoke(cli, ["--socket", daemon.path, *args], input=input)


def test_cli_submit_from_argument_stdin_and_file(daemon, tmp_path):
    result = invoke(daemon, "submit", "hello there world")
    assert result.exit_code == 0, result.output
    assert result.stdout == "hello there world\n"
    assert daemon.messages(Submit)[-1].stream is False  # stdout is not a terminal

    assert invoke(daemon, "submit", input="from stdin").stdout == "from stdin\n"
    assert invoke(daemon, "submit", "-", input="dash stdin").stdout == "dash stdin\n"
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("from a file")
    assert invoke(daemon, "submit", "--file", str(prompt_file)).stdout == "from a file\n"


def test_cli_submit_stream_json_and_settings(daemon):
    result = invoke(daemon, "submit", "a b c d", "--stream", "--max-tokens", "3", "--temperature", "0",
                    "--top-p", "0.5", "--top-k", "5", "--seed", "1", "--stop", "X", "--stop", "Y")
    assert result.exit_code == 0 and result.stdout == "a b c \n"
    submit = daemon.messages(Submit)[-1]
    assert submit.stream is True
    assert submit.sampling == SamplingParams(max_tokens=3, temperature=0.0, top_p=0.5, top_k=5, seed=1,
                                             stop=["X", "Y"])

    result = invoke(daemon, "submit", "json please", "--json")
    data = json.loads(result.stdout)
    assert data["text"] == "json please" and data["token_ids"] == [5, 6]
    assert data["finish_reason"] == "stop" and data["request_id"].startswith("req-")
    assert data["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "cached_tokens": 0}

    result = invoke(daemon, "submit", "p q", "--n", "2")
    assert result.stdout.count("--- sample") == 2 and "[1] p q" in result.stdout


def test_cli_exit_codes(daemon, short_dir):
    result = invoke(daemon, "submit", "TOOLONG")
    assert result.exit_code == 1
    assert result.stderr == "llmctl: too_long: prompt has 5000 tokens; the limit is 2048\n"
    result = invoke(daemon, "submit", "x", "--temperature", "-1")
    assert result.exit_code == 2 and "temperature must be >= 0" in result.stderr
    result = invoke(daemon, "abort", "req-nope")
    assert result.exit_code == 1 and result.stderr.startswith("llmctl: unknown_id: ")
    result = CliRunner().invoke(cli, ["--socket", os.path.join(short_dir, "none.sock"), "status"])
    assert result.exit_code == 3 and result.stderr.count("\n") == 1 and "llmd serve" in result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_cli_status_metrics_and_abort(daemon, client):
    stream = client.stream("FOREVER", max_tokens=100_000)
    result = invoke(daemon, "status")
    assert result.exit_code == 0
    for expected in ("fake-model", "1h 02m 05s", "cpu / float32", "waiting", "25.0%", "50.0%", "42.5 tokens/s",
                     "3.0 GiB", stream.request_id):
        assert expected in result.stdout
    data = json.loads(invoke(daemon, "status", "--json").stdout)
    assert data["model"] == "fake-model" and stream.request_id in [r["request_id"] for r in data["requests"]]
    assert invoke(daemon, "metrics").stdout == METRICS_TEXT

    result = invoke(daemon, "abort", stream.request_id)
    assert result.exit_code == 0
    assert list(stream)[-1].finish_reason == "abort"


# -- llmctl as a real process -------------------------------------------------------------------

def llmctl(*args, input=None, socket_path=None):
    return subprocess.run([LLMCTL, "--socket", socket_path, *args], input=input, capture_output=True,
                          text=True, timeout=20)


def test_llmctl_process_submit_status_metrics_abort(daemon):
    out = llmctl("submit", "from a process", socket_path=daemon.path)
    assert (out.returncode, out.stdout, out.stderr) == (0, "from a process\n", "")
    out = llmctl("submit", "--json", "--no-stream", input="piped words", socket_path=daemon.path)
    assert out.returncode == 0 and json.loads(out.stdout)["text"] == "piped words"
    assert daemon.messages(Submit)[-1].stream is False
    out = llmctl("status", socket_path=daemon.path)
    assert out.returncode == 0 and "fake-model" in out.stdout
    out = llmctl("metrics", socket_path=daemon.path)
    assert out.returncode == 0 and out.stdout == METRICS_TEXT
    out = llmctl("abort", "req-nope", socket_path=daemon.path)
    assert out.returncode == 1 and out.stderr.startswith("llmctl: unknown_id:") and "Traceback" not in out.stderr


def test_llmctl_process_without_daemon_exits_3_with_one_line(short_dir):
    out = llmctl("submit", "x", socket_path=os.path.join(short_dir, "none.sock"))
    assert out.returncode == 3 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("llmctl: llmd is not running")


# llmctl as a shell starts it: SIGINT handled by default and not blocked. A child inherits
# its parent's blocked signals and ignored ones across exec, and a test process that ran
# other tests first may have either: twice in full suites under xdist (never alone) llmctl
# streamed on through the Ctrl-C here, as it does when the test process blocks SIGINT.
_AS_A_SHELL_STARTS_IT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                         "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT]); os.execv(sys.argv[1], sys.argv[1:])")


def test_llmctl_process_ctrl_c_aborts_and_exits_130(daemon):
    proc = subprocess.Popen([sys.executable, "-c", _AS_A_SHELL_STARTS_IT, LLMCTL, "--socket", daemon.path, "submit",
                             "FOREVER", "--stream", "--max-tokens", "1000000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.read(5) == "tick "  # it is streaming
        submitted = daemon.last_submit()
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 130 and stderr == ""
    daemon.wait_for(lambda: submitted in daemon.aborted())
