"""Requests are owned by the peer's uid (SO_PEERCRED): another user can neither see nor
abort them; root (an admin) can. The second user is a real process under uid 65534
(`setpriv`), so this runs only as root."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from daemon_util import Daemon, RawConn
from llmd_tools.make_model import fixture_path

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or
                                not os.path.exists("/usr/bin/python3"),
                                reason="needs root, setpriv and /usr/bin/python3")

# Runs as the other user with the system Python and only the standard library (JSON lines).
OTHER_USER = r"""
import json, socket, sys
path, victim = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX); s.connect(path); f = s.makefile("rwb")
def send(m): f.write(json.dumps(m).encode() + b"\n"); f.flush()
def recv(): return json.loads(f.readline())
out = {}
send({"type": "abort", "id": victim}); out["abort_other"] = recv()
send({"type": "abort", "id": "r000000000000"}); out["abort_missing"] = recv()
send({"type": "status"}); out["status"] = recv()
send({"type": "submit", "id": "mine", "prompt": "hi", "sampling": {"max_tokens": 200, "ignore_eos": True}})
accepted = recv(); out["accepted"] = accepted
send({"type": "abort", "id": accepted["request_id"]})
while True:
    m = recv()
    if m.get("usage"): out["own_final"] = m; break
print(json.dumps(out))
"""


def test_users_cannot_see_or_abort_each_others_requests():
    base = Path(tempfile.mkdtemp(prefix="llmd-own-"))
    base.chmod(0o755)
    d = Daemon(str(fixture_path("tiny-llama")), base / "llmd.sock", "--max-model-len", "1024").wait_ready()
    try:
        os.chmod(d.sock, 0o666)  # let the other user connect; ownership is what is tested
        with RawConn(d.sock) as conn:
            conn.send({"type": "submit", "id": "root-req", "prompt": "hi",
                       "sampling": {"max_tokens": 1000, "ignore_eos": True}})
            accepted = conn.recv()
            victim = accepted["request_id"]
            proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                   "/usr/bin/python3", "-c", OTHER_USER, d.sock, victim],
                                  capture_output=True, text=True, timeout=60, cwd="/")
            assert proc.returncode == 0, proc.stderr
            other = json.loads(proc.stdout)
            # Another user's request answers as a missing one would: its existence is not told.
            assert other["abort_other"]["code"] == "unknown_id"
            assert other["abort_missing"] == {**other["abort_other"], "id": other["abort_missing"]["id"]}
            assert victim not in {r["request_id"] for r in other["status"]["requests"]}
            assert other["own_final"]["finish_reason"] == "abort"  # one's own: allowed
            # Root is an admin: sees and may abort anyone's; its own request is still running.
            conn.send({"type": "status"})
            while (reply := conn.recv())["type"] != "status_reply":
                pass
            assert victim in {r["request_id"] for r in reply["requests"]}
            conn.send({"type": "abort", "id": "root-req"})
            final = conn.until_final("root-req")[-1]
            assert final["finish_reason"] == "abort"
    finally:
        assert d.stop() == 0, d.stderr()
        shutil.rmtree(base, ignore_errors=True)


# The other user sends a prompt twice and reports the cached_tokens of each reply.
OTHER_USER_PROMPT = r"""
import json, socket, sys
path, prompt = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX); s.connect(path); f = s.makefile("rwb")
cached = []
for i in range(2):
    f.write(json.dumps({"type": "submit", "id": str(i), "prompt": prompt, "stream": False,
                        "sampling": {"max_tokens": 1}}).encode() + b"\n"); f.flush()
    while True:
        m = json.loads(f.readline())
        if m.get("usage"): cached.append(m["usage"]["cached_tokens"]); break
print(json.dumps(cached))
"""
SHARED_PROMPT = "class Config:\n    def __init__(self, path):\n        self.path = path\n" * 4


def cached_tokens_of_two_sends(sock: str) -> list[int]:
    with RawConn(sock) as conn:
        out = []
        for i in range(2):
            conn.send({"type": "submit", "id": str(i), "prompt": SHARED_PROMPT, "stream": False,
                       "sampling": {"max_tokens": 1}})
            out.append(conn.until_final(str(i))[-1]["usage"]["cached_tokens"])
    return out


def other_user_cached_tokens(sock: str) -> list[int]:
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           "/usr/bin/python3", "-c", OTHER_USER_PROMPT, sock, SHARED_PROMPT],
                          capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("scope", ["user", "shared"])
def test_prefix_cache_is_per_user_unless_shared(scope):
    """By default another user's identical prompt is no cache hit (no timing or
    cached_tokens oracle across users); the operator may share the cache."""
    base = Path(tempfile.mkdtemp(prefix="llmd-salt-"))
    base.chmod(0o755)
    d = Daemon(str(fixture_path("tiny-llama")), base / "llmd.sock", "--max-model-len", "1024",
               "--prefix-cache-scope", scope).wait_ready()
    try:
        os.chmod(d.sock, 0o666)
        mine = cached_tokens_of_two_sends(d.sock)
        assert mine[0] == 0 and mine[1] > 0  # one's own prompt is reused
        others = other_user_cached_tokens(d.sock)
        if scope == "user":
            assert others[0] == 0 and others[1] == mine[1]  # only their own first send helps them
        else:
            assert others[0] == mine[1]
    finally:
        assert d.stop() == 0, d.stderr()
        shutil.rmtree(base, ignore_errors=True)


# The other user sends one request and reports when its final message came.
OTHER_USER_ONE = r"""
import json, socket, sys, time
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); f = s.makefile("rwb")
f.write(json.dumps({"type": "submit", "id": "o", "prompt": "hi", "stream": False,
                    "sampling": {"max_tokens": 20, "ignore_eos": True}}).encode() + b"\n"); f.flush()
first = json.loads(f.readline())
while True:
    m = json.loads(f.readline())
    if m.get("usage"): break
print(json.dumps({"first": first, "done": time.time()}))
"""


def test_one_users_flood_meets_their_quota_and_others_take_turns(tmp_path_factory):
    """Root pipelines 20 requests: 6 are admitted (its quota), the rest refused by name;
    another user's request, sent after, runs next rather than behind root's queue."""
    base = Path(tempfile.mkdtemp(prefix="llmd-fair-"))
    base.chmod(0o755)
    config = base / "llmd.toml"
    config.write_text("max_pending_requests_per_user = 6\nmax_num_seqs = 1\n")
    d = Daemon(str(fixture_path("tiny-llama")), base / "llmd.sock", "--config", str(config)).wait_ready()
    try:
        os.chmod(d.sock, 0o666)
        with RawConn(d.sock) as conn:
            for i in range(20):
                conn.send({"type": "submit", "id": f"r{i}", "prompt": "hi", "stream": False,
                           "sampling": {"max_tokens": 40, "ignore_eos": True}})
            first = {}
            while len(first) < 20:
                m = conn.recv()
                first.setdefault(m["id"], m)
            refused = [m for m in first.values() if m["type"] == "error"]
            assert len(refused) == 14 and {m["code"] for m in refused} == {"overloaded"}
            assert "from this user (limit 6)" in refused[0]["message"]
            proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                   "/usr/bin/python3", "-c", OTHER_USER_ONE, d.sock],
                                  capture_output=True, text=True, timeout=60, cwd="/")
            assert proc.returncode == 0, proc.stderr
            other = json.loads(proc.stdout)
            assert other["first"]["type"] == "accepted"  # root's quota is root's alone
            done = {}
            while len(done) < 6:
                m = conn.recv()
                if m.get("usage"):
                    done[m["id"]] = time.time()
        # With one sequence at a time, the other user's request ran second or third,
        # not seventh: at least four of root's six finished after it.
        assert sum(t > other["done"] for t in done.values()) >= 4, (sorted(done.values()), other["done"])
    finally:
        assert d.stop() == 0, d.stderr()
        shutil.rmtree(base, ignore_errors=True)
