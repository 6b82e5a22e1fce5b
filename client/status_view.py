"""The daemon's StatusReply as the text `llmctl status` prints and `llmctl top` refreshes:
one line per part of the default model's engine, a table of the models when there are
several, then a table of the running requests; and the table `llmctl ps` prints."""
from __future__ import annotations

import time

from llmd_client.durations import describe_duration
from llmd_client.protocol import ModelStatus, StatusReply


def format_status(s: StatusReply) -> str:
    """The status as aligned "name  value" lines (and the requests' table, when any run)."""
    lines = [
        f"model        {s.model}  (llmd {s.server_version})",
        f"uptime       {_duration(s.uptime_s)}",
        f"engine       {_engine_state(s)}",
        f"device       {s.device} / {s.dtype}",
        f"requests     {s.num_running} running, {s.num_waiting} waiting, {s.requests_finished_total} finished",
        f"kv cache     {s.kv_blocks_used} / {s.kv_blocks_total} blocks ({s.kv_usage:.1%})"
        + (f", {s.kv_cache_dtype}" if s.kv_cache_dtype else "")
        + (f" ({s.kv_cache_scales} scales)" if s.kv_cache_scales else "")
        + (f"; {_bytes(s.memory.kv_cache_used)} of {_bytes(s.memory.kv_cache)}" if s.memory is not None else ""),
        f"prefix hits  {s.prefix_cache_hit_rate:.1%}",
        f"throughput   {s.generation_tokens_per_s:.1f} tokens/s; {s.prompt_tokens_total} prompt and "
        f"{s.generation_tokens_total} generated tokens in total",
        _memory_line(s),
    ]
    if s.memory is not None:
        weights = sorted(s.memory.weights.items(), key=lambda kv: -kv[1])
        lines.append(f"weights      {_bytes(sum(s.memory.weights.values()))}"
                     + (": " + ", ".join(f"{kind} {_bytes(n)}" for kind, n in weights) if weights else ""))
        lines.append(f"other        {_bytes(s.memory.other)} (activations, runtime, caches)")
    if s.num_preemptions_total:
        lines.append(f"preemptions  {s.num_preemptions_total}")
    if s.grammar_compiles_total:
        lines.append(f"grammars     {s.grammar_compiles_total} compiled, "
                     f"{1e3 * s.grammar_compile_seconds_total / s.grammar_compiles_total:.1f} ms each on average")
    if s.spec_decode is not None:
        sd = s.spec_decode
        per_pos = ", ".join(str(n) for n in sd.accepted_per_position) or "-"
        lines.append(f"speculation  {sd.num_accepted_tokens} / {sd.num_draft_tokens} drafts accepted "
                     f"({sd.acceptance_rate:.1%}), {sd.mean_accepted_length:.2f} tokens per verifying step; "
                     f"accepted by position: {per_pos}")
    if len(s.models) > 1:
        lines += ["", format_models(s.models)]
    if s.requests:
        rows = [("REQUEST", "UID", "STATE", "AGE", "PROMPT", "GENERATED", "MODEL")]
        rows += [(r.request_id, str(r.uid), r.state, _duration(r.age_s), str(r.prompt_tokens),
                  str(r.completion_tokens), r.model) for r in s.requests]
        lines += ["", _table(rows)]
    return "\n".join(lines)


def format_models(models: list[ModelStatus]) -> str:
    """One row per model: its state (load progress, error), memory (held, or ~estimated),
    device, requests, and until when it stays (`llmctl ps`)."""
    rows = [("NAME", "TASK", "STATE", "MEMORY", "DEVICE", "REQUESTS", "UNTIL")]
    for m in models:
        memory = (_bytes(m.memory_bytes) if not m.memory_estimated else f"~{_bytes(m.memory_bytes)}") \
            if m.memory_bytes else "-"
        rows.append((m.name + (" (default)" if m.default else ""), m.task, _model_state(m), memory, m.device or "-",
                     f"{m.num_running} running, {m.num_waiting} waiting", _until(m)))
    return _table(rows)


def _model_state(m: ModelStatus) -> str:
    if m.state == "loading":
        return f"loading ({100 * (m.load_progress or 0.0):.0f}%: {m.load_phase or 'starting'})"
    if m.error and m.state in ("failed", "restarting", "dead"):
        return f"{m.state}: {m.error}"
    if m.state in ("sleeping", "asleep") and m.sleep_level is not None:
        return f"{m.state} (level {m.sleep_level})"
    return m.state


def _until(m: ModelStatus) -> str:
    if m.state != "serving":
        return "-"
    then = ", then asleep" if m.idle_action == "sleep" else ""
    if m.expires_at is not None:
        when = time.strftime("%H:%M:%S", time.localtime(m.expires_at))
        return f"{when} (in {_duration(max(0.0, m.expires_at - time.time()))}{then})"
    if m.keep_alive_s is not None:
        return f"{describe_duration(m.keep_alive_s)} after its requests{then}"
    return "forever"


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _engine_state(s: StatusReply) -> str:
    """"serving", "restarting (2): <cause>", "dead: <cause>", "serving; 1 worker restart ..."."""
    match s.engine_state:
        case "loading":
            return f"loading ({100 * (s.load_progress or 0.0):.0f}%: {s.load_phase or 'starting'})"
        case "unloaded" | "failed" as state:
            return f"{state} (a request loads it again)" + (f"; the last failure: {s.engine_error}"
                                                            if s.engine_error else "")
        case "asleep":
            level = next((m.sleep_level for m in s.models if m.default), None)
            return f"asleep{f' (level {level})' if level else ''}: a request wakes it"
        case "restarting":
            return f"restarting ({s.engine_restarts}): {s.engine_error}"
        case "dead":
            return f"dead: {s.engine_error}"
        case state if s.engine_restarts:
            plural = "" if s.engine_restarts == 1 else "s"
            return f"{state}; {s.engine_restarts} worker restart{plural}, the last after: {s.engine_error}"
        case state:
            return state


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d {hours}h {minutes:02d}m"
    if hours:
        return f"{hours}h {minutes:02d}m {secs:02d}s"
    return f"{minutes}m {secs:02d}s"


def _memory_line(s: StatusReply) -> str:
    workers = s.memory.workers_rss if s.memory is not None else None
    rss = (f"{_bytes(s.rss_bytes + workers)} RSS (daemon {_bytes(s.rss_bytes)}, workers {_bytes(workers)})"
           if workers is not None else f"{_bytes(s.rss_bytes)} RSS")
    device = f"; device {_bytes(s.device_memory_bytes)}" if s.device_memory_bytes is not None else ""
    return f"memory       {rss}, CPU {s.cpu_percent:.0f}%{device}"


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
