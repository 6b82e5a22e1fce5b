"""The systemd units and snippets in systemd/: `systemd-analyze verify` is clean (exit 0
and nothing on stderr or stdout), the sandbox's exposure score stays low, and the
units, sysusers.d, tmpfiles.d, the example llmd.toml and the daemon agree on names,
paths, owners and modes."""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SYSTEMD = ROOT / "systemd"
SERVICE = SYSTEMD / "llmd.service"
SOCKET = SYSTEMD / "llmd.socket"
SYSUSERS = SYSTEMD / "llmd.sysusers.conf"
TMPFILES = SYSTEMD / "llmd.tmpfiles.conf"
EXAMPLE_TOML = SYSTEMD / "llmd.toml"

EXEC_START = "/usr/bin/llmd serve --config /etc/llmd/llmd.toml"
# `systemd-analyze security --offline=true llmd.service` measured 1.0 ("OK") with
# systemd 252; the slack allows for checks added by other systemd versions.
MAX_EXPOSURE = 1.2

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze is not installed")


# ------------------------------------------------------------------ parsing ----

class Unit:
    """A unit file as systemd reads it: sections of `Key=value` lines, `#`/`;` comments;
    a key may repeat (list settings), and an empty assignment resets the list."""

    def __init__(self, path: Path) -> None:
        self.sections: dict[str, dict[str, list[str]]] = {}
        section = None
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not line or line[0] in "#;":
                continue
            assert not line.endswith("\\"), f"{path.name}: keep settings on one line: {raw!r}"
            if line.startswith("["):
                section = line.strip("[]")
                self.sections.setdefault(section, {})
                continue
            assert section is not None, f"{path.name}: setting outside a section: {raw!r}"
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: not a Key=value line: {raw!r}"
            values = self.sections[section].setdefault(key.strip(), [])
            if value.strip():
                values.append(value.strip())
            else:
                values.clear()

    def all(self, section: str, key: str) -> list[str]:
        return self.sections.get(section, {}).get(key, [])

    def get(self, section: str, key: str) -> str | None:
        values = self.all(section, key)
        return values[-1] if values else None

    def words(self, section: str, key: str) -> list[str]:
        return [w for v in self.all(section, key) for w in v.split()]


def seconds(value: str) -> float:
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600, "ms": 0.001}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * units[unit]
    return total


def table_lines(path: Path) -> list[list[str]]:
    """Non-comment lines of a sysusers.d/tmpfiles.d file, split into fields (quotes kept
    together)."""
    rows = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            rows.append(re.findall(r'"[^"]*"|\S+', line))
    return rows


@pytest.fixture(scope="module")
def service() -> Unit:
    return Unit(SERVICE)


@pytest.fixture(scope="module")
def sock() -> Unit:
    return Unit(SOCKET)


def tmpfiles_dir_line() -> list[str]:
    rows = [r for r in table_lines(TMPFILES) if r[0] == "d"]
    assert len(rows) == 1, rows
    return rows[0]


# ------------------------------------------------------------ systemd tools ----

@pytest.fixture
def unit_dir(tmp_path) -> Path:
    """Copies of both units; ExecStart points at a dummy executable, because verify
    checks that the binary exists (llmd is not installed to /usr/bin here)."""
    binary = tmp_path / "llmd"
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    text = SERVICE.read_text()
    assert text.count(f"\nExecStart={EXEC_START}\n") == 1
    text = text.replace(f"\nExecStart={EXEC_START}\n", f"\nExecStart={binary} serve --config /etc/llmd/llmd.toml\n")
    (tmp_path / "llmd.service").write_text(text)
    shutil.copy(SOCKET, tmp_path / "llmd.socket")
    return tmp_path


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, SYSTEMD_LOG_COLOR="0", SYSTEMD_PAGER="", LC_ALL="C.UTF-8"))


@needs_analyze
def test_systemd_analyze_verify_is_clean(unit_dir):
    # Warnings (unknown keys, bad values) still exit 0: stderr must be empty too.
    r = run("systemd-analyze", "verify", "llmd.service", "llmd.socket", cwd=unit_dir)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr
    assert r.stdout == "", r.stdout


@needs_analyze
def test_verify_would_catch_a_warning(unit_dir):
    # Guards the test above: a typo in a key is reported on stderr, with exit code 0.
    path = unit_dir / "llmd.service"
    path.write_text(path.read_text().replace("ProtectClock=yes", "ProtectClok=yes"))
    r = run("systemd-analyze", "verify", "llmd.service", "llmd.socket", cwd=unit_dir)
    assert "ProtectClok" in r.stderr


@needs_analyze
def test_security_exposure(unit_dir):
    r = run("systemd-analyze", "security", "--offline=true", str(unit_dir / "llmd.service"),
            cwd=unit_dir)
    assert r.returncode == 0, r.stderr
    m = re.search(r"Overall exposure level for llmd\.service: (\d+(?:\.\d+)?) (\w+)", r.stdout)
    assert m, r.stdout + r.stderr
    score = float(m.group(1))
    print(f"\nsystemd-analyze security: llmd.service exposure {score} {m.group(2)}")
    for line in r.stdout.splitlines():
        if line.startswith("✗"):
            print("  " + " ".join(line.split()))
    assert score <= MAX_EXPOSURE, r.stdout


@pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("systemd-sysusers") and shutil.which("systemd-tmpfiles")),
                    reason="needs root (tmpfiles chowns) and systemd-sysusers/systemd-tmpfiles")
def test_sysusers_and_tmpfiles_apply(tmp_path):
    """Applied to an empty root as a package install would: user and group llmd exist and
    /run/llmd comes out 0750 llmd:llmd, as the units expect."""
    root = tmp_path / "root"
    for d in ("etc", "usr/lib/sysusers.d", "usr/lib/tmpfiles.d", "run"):
        (root / d).mkdir(parents=True)
    shutil.copy(SYSUSERS, root / "usr/lib/sysusers.d/llmd.conf")
    shutil.copy(TMPFILES, root / "usr/lib/tmpfiles.d/llmd.conf")
    r = run("systemd-sysusers", f"--root={root}", "llmd.conf", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    passwd = {l.split(":")[0]: l.split(":") for l in (root / "etc/passwd").read_text().splitlines()}
    groups = {l.split(":")[0]: l.split(":") for l in (root / "etc/group").read_text().splitlines()}
    assert "llmd" in passwd and "llmd" in groups and "llmd-admin" in groups
    user = passwd["llmd"]
    assert user[3] == groups["llmd"][2]  # primary group llmd
    assert user[5] == "/var/lib/llmd"
    assert user[6].endswith("nologin")
    # The same basename lookup llmd.socket's ExecStartPre= relies on.
    r = run("systemd-tmpfiles", f"--root={root}", "--create", "llmd.conf", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    st = (root / "run/llmd").stat()
    assert stat.S_ISDIR(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o750
    assert (st.st_uid, st.st_gid) == (int(user[2]), int(groups["llmd"][2]))


# ------------------------------------------------------------- consistency ----

def test_socket_unit_matches_daemon_default(sock):
    from llmd_client.socket_path import SYSTEM_SOCKET, http_socket_path

    assert SYSTEM_SOCKET == "/run/llmd/llmd.sock"  # DESIGN.md: the system service's socket
    assert sock.all("Socket", "ListenStream") == [SYSTEM_SOCKET, http_socket_path(SYSTEM_SOCKET)]
    assert sock.get("Socket", "SocketMode") == "0660"
    assert sock.get("Socket", "SocketUser") == "llmd"
    assert sock.get("Socket", "SocketGroup") == "llmd"
    assert sock.get("Socket", "Accept") == "no"
    assert sock.get("Socket", "FileDescriptorName") == "llmd"
    assert sock.get("Socket", "DirectoryMode") == "0750"
    assert sock.get("Install", "WantedBy") == "sockets.target"
    # /run/llmd is made by the tmpfiles.d snippet (not as root:root by the socket unit).
    assert sock.get("Socket", "ExecStartPre") == "/usr/bin/systemd-tmpfiles --create llmd.conf"


def test_service_is_notify_with_watchdog(service):
    assert service.get("Service", "Type") == "notify"
    assert service.get("Service", "NotifyAccess") == "main"
    assert 10 <= seconds(service.get("Service", "WatchdogSec")) <= 300
    assert service.get("Service", "ExecStart") == EXEC_START
    assert service.get("Service", "User") == "llmd"
    assert service.get("Service", "Group") == "llmd"
    assert service.get("Service", "Restart") == "on-failure"
    assert seconds(service.get("Service", "TimeoutStartSec")) >= 600


def test_service_stop_outlasts_the_drain(service):
    from llmd.daemon_config import DaemonConfig

    drain = DaemonConfig().drain_timeout_s
    assert service.get("Service", "KillSignal") == "SIGTERM"
    # SIGTERM to the main process only: the workers keep serving the drain.
    assert service.get("Service", "KillMode") == "mixed"
    assert seconds(service.get("Service", "TimeoutStopSec")) >= drain + 10


def test_service_uses_the_socket(service):
    assert "llmd.socket" in service.words("Unit", "Requires")
    assert "llmd.socket" in service.words("Unit", "After")
    assert "llmd.socket" in service.words("Install", "Also")
    assert service.get("Install", "WantedBy") == "multi-user.target"


HARDENING = {
    "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
    "PrivateTmp": "yes", "PrivateDevices": "no", "DevicePolicy": "closed",
    "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes", "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes", "ProtectClock": "yes", "ProtectHostname": "yes",
    "RestrictNamespaces": "yes", "RestrictRealtime": "yes", "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes", "SystemCallArchitectures": "native",
    "CacheDirectory": "llmd", "StateDirectory": "llmd",
}


def test_service_hardening(service):
    for key, value in HARDENING.items():
        assert service.get("Service", key) == value, key
    assert service.all("Service", "CapabilityBoundingSet") == []  # empty: no capabilities
    assert "CapabilityBoundingSet=\n" in SERVICE.read_text()  # set, and to nothing
    assert service.get("Service", "MemoryDenyWriteExecute") is None  # Triton/JIT need W+X
    assert set(service.words("Service", "RestrictAddressFamilies")) <= {
        "AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    assert "AF_UNIX" in service.words("Service", "RestrictAddressFamilies")
    assert service.get("Service", "PrivateNetwork") == "yes"
    # Only NVIDIA devices beside the basic pseudo devices.
    allowed = [v.split()[0] for v in service.all("Service", "DeviceAllow")]
    assert allowed and all("nvidia" in d for d in allowed), allowed
    assert {"char-nvidia-frontend", "char-nvidia-uvm", "/dev/nvidiactl"} <= set(allowed)
    # System calls: @system-service minus @privileged and @resources, NUMA policy kept.
    filters = service.all("Service", "SystemCallFilter")
    assert filters[0] == "@system-service"
    assert filters[1].startswith("~") and set(filters[1][1:].split()) == {"@privileged", "@resources"}
    assert {"mbind", "set_mempolicy", "sched_setaffinity"} <= set(filters[2].split())
    assert len(filters) == 3


def test_runtime_directory_agrees_with_socket_and_tmpfiles(service, sock):
    kind, path, mode, user, group, *_ = tmpfiles_dir_line()
    socket_dirs = {os.path.dirname(p) for p in sock.all("Socket", "ListenStream")}
    assert [path] == list(socket_dirs) == ["/run/" + service.get("Service", "RuntimeDirectory")]
    assert mode == service.get("Service", "RuntimeDirectoryMode") == sock.get("Socket", "DirectoryMode")
    assert user == service.get("Service", "User") == sock.get("Socket", "SocketUser")
    assert group == service.get("Service", "Group") == sock.get("Socket", "SocketGroup")
    # The socket must outlive a restart of the service.
    assert service.get("Service", "RuntimeDirectoryPreserve") == "yes"


def test_sysusers_defines_the_units_user_and_groups(service):
    from llmd.daemon_config import DaemonConfig

    rows = table_lines(SYSUSERS)
    users = {r[1]: r for r in rows if r[0] == "u"}
    groups = {r[1] for r in rows if r[0] in ("u", "g")}
    assert set(users) == {service.get("Service", "User")}
    assert service.get("Service", "Group") in groups
    assert DaemonConfig().admin_group in groups
    home = users["llmd"][4]
    assert home == "/var/lib/" + service.get("Service", "StateDirectory")


# ----------------------------------------------------------- example config ----

SETTING = re.compile(r"^#([a-z][a-z0-9_]*) = (.+)$")


def uncommented(text: str) -> str:
    return "\n".join(m.group(1) + " = " + m.group(2) if (m := SETTING.match(line)) else line
                     for line in text.splitlines())


def test_example_config_lists_every_setting_with_its_default(tmp_path):
    from llmd.config import EngineConfig
    from llmd.daemon_config import DaemonConfig, load_settings

    text = EXAMPLE_TOML.read_text()
    assert tomllib.loads(text) == {}  # everything commented out
    values = tomllib.loads(uncommented(text))
    expected = {**{f: getattr(DaemonConfig(), f) for f in DaemonConfig.__struct_fields__},
                **{f: getattr(EngineConfig(), f) for f in EngineConfig.__struct_fields__}}
    assert set(values) == set(expected), set(values) ^ set(expected)
    for key, default in expected.items():
        if default not in (None, ""):  # unset by default: the file shows an example
            assert values[key] == default, key
    # The uncommented file is a valid configuration for the daemon.
    path = tmp_path / "llmd.toml"
    path.write_text(uncommented(text))
    daemon, engine = load_settings(str(path), {})
    assert daemon.socket == "/run/llmd/llmd.sock"
    assert engine.model.startswith("/var/lib/llmd/")
    daemon, engine = load_settings(str(EXAMPLE_TOML), {})
    assert daemon == DaemonConfig() and engine == EngineConfig()
