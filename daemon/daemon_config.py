"""The daemon's own settings (sockets, limits, the HTTP APIs, worker restarts) and how
they are read: a flat TOML file holding engine and daemon settings side by side, then
the command line's overrides, split into a `DaemonConfig` and an `EngineConfig`."""
from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from llmd.config import EngineConfig
from llmd_client.durations import parse_duration


class DaemonConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The daemon's settings, beside the engine's (EngineConfig) in one flat TOML file."""

    socket: str | None = None
    socket_group: str = "llmd"
    admin_group: str | None = "llmd-admin"
    drain_timeout_s: float = 30.0
    max_pending_requests: int = 4096
    # ... of one user, and on one connection, and one user's prompt tokens (times samples)
    # in flight: one user's flood meets their own limit while others are still served.
    max_pending_requests_per_user: Annotated[int, msgspec.Meta(ge=1)] = 1024
    max_pending_requests_per_connection: Annotated[int, msgspec.Meta(ge=1)] = 512
    max_pending_tokens_per_user: Annotated[int, msgspec.Meta(ge=1)] = 1 << 20
    # Connections waiting to be accepted (the kernel caps it at net.core.somaxconn).
    listen_backlog: Annotated[int, msgspec.Meta(ge=16)] = 4096
    # Open protocol connections, in all and from one user; more are refused with a reason
    # (the open-files limit is raised to its hard maximum at start, and caps these).
    max_connections: Annotated[int, msgspec.Meta(ge=1)] = 4096
    max_connections_per_user: Annotated[int, msgspec.Meta(ge=1)] = 256
    # A connection with no request in flight that sends nothing for this long is closed.
    idle_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    log_level: str = "info"
    # Prometheus text over HTTP at http://127.0.0.1:PORT/metrics; None: no listener.
    metrics_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None
    # Cached prompt prefixes are shared only between requests of one user ("user"), or
    # between all users ("shared": faster for common system prompts, but one user's
    # timing then reveals what another has sent).
    prefix_cache_scope: Literal["user", "shared"] = "user"
    # The HTTP APIs (OpenAI, Ollama, llama.cpp /infill) on a Unix socket beside the
    # protocol socket (http_socket; default <socket dir>/<name>-http.sock).
    http: bool = True
    http_socket: str | None = None
    # ... and on a TCP port of http_host, which needs an API key (api_key, api_key_file
    # or $LLMD_API_KEY) unless http_require_api_key is false.
    http_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None
    http_host: str = "127.0.0.1"
    api_key: str | None = None
    api_key_file: str | None = None
    http_require_api_key: bool = True
    # Web pages (browser origins, e.g. "https://chat.example.com", "chrome-extension://*";
    # `*` matches any text) that may call the HTTP APIs, beside the default: localhost,
    # 127.0.0.1, 0.0.0.0 and [::1] on any port, and app://, file://, tauri://,
    # vscode-webview://, vscode-file:// (as Ollama's OLLAMA_ORIGINS). Other origins are
    # refused, as are TCP requests whose Host is neither loopback, an IP address,
    # http_host nor an http(s) host listed here (DNS rebinding).
    http_allowed_origins: list[str] = []
    # The names clients may ask for the model by, on every HTTP face (vLLM's
    # served_model_name): one name or a list, the first the one /v1/models, /api/tags
    # and responses report. None: the model's file or folder name.
    served_model_name: str | list[str] | None = None
    # More models, by name: each table holds `path` (a model directory or GGUF file), engine
    # settings over the top-level ones, `aliases`, `keep_alive`, `idle_action`, `sleep_level`
    # and `tool_call_parser`
    # (see llmd.pool.registry). Requests name them in their `model` field; the model
    # above (`model`) is the default, for requests that name none.
    models: dict[str, Any] | None = None
    # Requests may also name a model by its absolute path (the daemon reads it with its
    # own rights): off, only the models above are served.
    allow_model_paths: bool = False
    # How long a model stays loaded once its last request is done: seconds or a duration
    # ("5m"; negative: for ever; 0: unload at once); a request's keep_alive overrides it.
    # None: the default model stays, the [models.NAME] ones stay 5 minutes.
    keep_alive: str | int | float | None = None
    # What keep_alive's end does to an idle model: "unload" it (its memory and worker
    # processes go), or "sleep": free its KV cache and keep its weights in host memory
    # (sleep_level 1: on a GPU copied to pinned RAM, on CPU where they are) or drop them
    # (sleep_level 2: read from the files again at wake); its worker processes stay and
    # its next request wakes it. A [models.NAME] table may set its own.
    idle_action: Literal["unload", "sleep"] = "unload"
    sleep_level: Literal[1, 2] = 1
    # At most this many models loaded at once; None: no limit but memory.
    max_loaded_models: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # Bytes the loaded models may take per device ("cpu", "cuda" for each GPU, or
    # "cuda:N"): weights plus KV pool (estimated from the files and the KV setting
    # before a load). A model that needs a device without an entry is not limited there.
    model_memory_budget_bytes: dict[str, Annotated[int, msgspec.Meta(ge=1)]] | None = None
    # How the model writes tool calls (vLLM's tool_call_parser): "hermes", "llama3_json"
    # or "mistral"; None: read from the chat template (its call markers), else the
    # model's family, else hermes.
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] | None = None
    # When guided decoding makes every tool call valid for its schema: "forced" (when the
    # request's tool_choice is required or names a function) or "always" (also with
    # tool_choice auto: calls are then always valid, and text may not look like a call).
    guided_tool_calls: Literal["forced", "always"] = "forced"
    # /health answers 503 when requests wait and no engine step has ended for this long.
    health_stall_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    # A failed worker (died, or hung past its step deadline) is restarted after
    # worker_restart_backoff_s, doubling with each failure in the window up to
    # worker_restart_backoff_max_s; worker_max_failures within worker_failure_window_s
    # declare the engine dead: the daemon fails every request and exits non-zero.
    worker_restart_backoff_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    worker_restart_backoff_max_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    worker_max_failures: Annotated[int, msgspec.Meta(ge=1)] = 5
    worker_failure_window_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0

    def __post_init__(self) -> None:
        names = self.served_names(())
        if any(not n or n != n.strip() for n in names) or len(set(names)) != len(names):
            raise ValueError("served_model_name must be distinct names, none empty or with surrounding spaces")
        if self.keep_alive is not None:
            parse_duration(self.keep_alive, "keep_alive")
        for device in self.model_memory_budget_bytes or {}:
            kind, _, index = device.partition(":")
            if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
                raise ValueError('model_memory_budget_bytes keys must be "cpu", "cuda" (each GPU) or "cuda:N"')

    def served_names(self, default: tuple[str, ...]) -> tuple[str, ...]:
        """served_model_name as a tuple of names; `default` when unset."""
        if self.served_model_name is None or self.served_model_name == []:
            return default
        if isinstance(self.served_model_name, str):
            return (self.served_model_name,)
        return tuple(self.served_model_name)


def load_settings(config_file: str | None, overrides: dict[str, Any]) -> tuple[DaemonConfig, EngineConfig]:
    """TOML file (flat keys: engine settings by their vLLM names, daemon settings beside
    them), then command-line overrides. Unknown keys are errors."""
    values: dict[str, Any] = {}
    if config_file:
        try:
            values.update(tomllib.loads(Path(config_file).read_text()))
        except OSError as exc:
            raise ValueError(f"cannot read config file {config_file}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {config_file} is not valid TOML: {exc}") from None
    values.update({k: v for k, v in overrides.items() if v is not None})
    daemon_keys = set(DaemonConfig.__struct_fields__)
    engine_keys = set(EngineConfig.__struct_fields__)
    unknown = sorted(set(values) - daemon_keys - engine_keys)
    if unknown:
        raise ValueError(f"unknown setting(s): {', '.join(unknown)}")
    try:
        daemon = msgspec.convert({k: v for k, v in values.items() if k in daemon_keys}, DaemonConfig)
        engine = msgspec.convert({k: v for k, v in values.items() if k in engine_keys}, EngineConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid setting: {exc}") from None
    model_registry(daemon, engine)  # its errors name the table and key, before anything starts
    return daemon, engine


def model_registry(daemon: DaemonConfig, engine: EngineConfig):
    """The models these settings serve (llmd.pool.registry.ModelRegistry)."""
    from llmd.pool.registry import ModelRegistry

    return ModelRegistry.from_settings(engine, default_names=daemon.served_names(()), tables=daemon.models,
                                       keep_alive=daemon.keep_alive, tool_call_parser=daemon.tool_call_parser,
                                       allow_model_paths=daemon.allow_model_paths, idle_action=daemon.idle_action,
                                       sleep_level=daemon.sleep_level)
