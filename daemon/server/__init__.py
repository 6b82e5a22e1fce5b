"""The daemon as a process: `llmd serve` (serve), its sockets, systemd's notify protocol and watchdog."""
