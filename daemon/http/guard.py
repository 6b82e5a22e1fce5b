"""What keeps web pages from driving the daemon through a browser (the daemon serves no
pages, but every page the user opens can make its browser send requests to loopback):

- DNS rebinding: a page on a name the attacker controls re-points that name to
  127.0.0.1, and is then "same-origin" with the daemon. Its requests carry the
  attacker's name in `Host`, so on TCP `Host` must name this machine's loopback
  (localhost, *.localhost, any IP address: a rebinding attack needs a name), http_host,
  or a host of an allowed origin. Requests on the Unix socket carry whatever Host the
  client sends and no browser can open them: they are not checked.
- Cross-origin requests: a request with an `Origin` that is not allowed is refused
  (403), on every transport, before its body is read. Allowed are Ollama's defaults
  (OLLAMA_ORIGINS): http(s)://localhost, 127.0.0.1, 0.0.0.0 and [::1] on any port, and
  the app://, file://, tauri://, vscode-webview:// and vscode-file:// schemes of
  desktop apps and editors; plus what the operator lists in http_allowed_origins (`*`
  matches any text, so "https://*.example.com" or "chrome-extension://*"; "*" alone
  allows every origin). An allowed origin gets CORS answers: its preflight (OPTIONS)
  is answered with the methods and headers it asks for, its responses carry
  Access-Control-Allow-Origin. Any other preflight is refused.
- Simple requests: a page can POST text/plain or a form cross-origin without a
  preflight, so JSON endpoints take only application/json from a browser (see
  llmd.http.context.check_json_content_type)."""
from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

# Ollama's default origins (envconfig.AllowedOrigins), with [::1] beside 127.0.0.1.
DEFAULT_ORIGINS = tuple(f"{scheme}://{host}{port}" for host in ("localhost", "127.0.0.1", "0.0.0.0", "[::1]")
                        for scheme in ("http", "https") for port in ("", ":*")) + \
    ("app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*")
ALLOWED_METHODS = "GET, POST, HEAD, OPTIONS"
HOST_REFUSED = ("the Host header names no host this daemon serves (DNS rebinding protection): use localhost "
                "or an IP address, or list the origin in http_allowed_origins")
PREFLIGHT_MAX_AGE_S = 600
# What a preflight may ask to send: header names (RFC 9110 tokens) separated by commas.
_HEADER_LIST = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+(?:[ \t]*,[ \t]*[!#$%&'*+.^_`|~0-9A-Za-z-]+)*")
_FALLBACK_HEADERS = "Authorization, Content-Type, Accept, User-Agent, X-Requested-With"
_PORT = re.compile(r"[0-9]{1,5}")


def _pattern(text: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in text.split("*")), re.IGNORECASE | re.DOTALL)


def split_host(header: str) -> str | None:
    """The host name or address of a Host header (lower case, without port, brackets or
    a trailing dot); None when it is not a well-formed host[:port]."""
    header = header.strip()
    if header.startswith("["):
        end = header.find("]")
        if end < 0:
            return None
        host, rest = header[1:end], header[end + 1:]
        if rest and not (rest.startswith(":") and _PORT.fullmatch(rest[1:])):
            return None
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return None
        return host.lower()
    host, colon, port = header.partition(":")
    if colon and not _PORT.fullmatch(port):
        return None
    host = host.lower().removesuffix(".")
    if not host or any(c in host for c in "/\\@[]% ") or not host.isascii():
        return None
    return host


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _web_host(origin: str) -> str:
    """The host of an http(s) origin pattern ("" for other schemes)."""
    scheme, sep, rest = origin.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        return ""
    try:
        return urlsplit(f"http://{rest}").hostname or ""
    except ValueError:
        return ""


class BrowserGuard:
    """The Host and Origin checks and the CORS answers, for one listener set."""

    def __init__(self, allowed_origins: list[str] | tuple[str, ...] = (), http_host: str | None = None) -> None:
        extra = [o.strip().rstrip("/") for o in allowed_origins if o.strip()]
        self.origins = [*DEFAULT_ORIGINS, *extra]
        self._origin_patterns = [_pattern(o) for o in self.origins]
        # Trusting the pages of an origin means trusting its name, so it may be the Host
        # (a proxy that keeps the browser's Host); "*" lets every origin in, and any Host.
        self.any_host = any(o == "*" for o in extra)
        hosts = [_web_host(o) for o in extra]
        if http_host:
            hosts.append(http_host.strip("[]"))
        self._host_patterns = [_pattern(h.lower().removesuffix(".")) for h in hosts if h]

    def host_allowed(self, header: str | None) -> bool:
        """Whether a TCP request's Host header may be served (a missing or empty one: an
        HTTP/1.0 client or a script, never a browser)."""
        if header is None or not header.strip() or self.any_host:
            return True
        host = split_host(header)
        if host is None:
            return False
        if host == "localhost" or host.endswith(".localhost") or _is_ip(host):
            return True
        return any(p.fullmatch(host) for p in self._host_patterns)

    def origin_allowed(self, origin: str) -> bool:
        origin = origin.strip()
        return any(p.fullmatch(origin) for p in self._origin_patterns)

    @staticmethod
    def cors_headers(origin: str) -> dict[str, str]:
        """Headers for a response to a request from an allowed origin."""
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}

    def preflight_headers(self, origin: str, request_headers: dict[str, str] | object) -> dict[str, str]:
        """The answer to an allowed origin's CORS preflight."""
        asked = request_headers.get("Access-Control-Request-Headers", "").strip()
        headers = {
            **self.cors_headers(origin),
            "Access-Control-Allow-Methods": ALLOWED_METHODS,
            "Access-Control-Allow-Headers": asked if _HEADER_LIST.fullmatch(asked) else _FALLBACK_HEADERS,
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
            "Vary": "Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
        }
        # Chrome's Private Network Access: a public page asking for loopback says so.
        if request_headers.get("Access-Control-Request-Private-Network", "").lower() == "true":
            headers["Access-Control-Allow-Private-Network"] = "true"
        return headers
