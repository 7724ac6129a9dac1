"""The request guard's header rules: the Host names a server answers, and the method, Origin,
Content-Type and Content-Encoding checks every request passes before a route sees it
(docs/server.md)."""

from __future__ import annotations

from gptoss_lite.server import protocol as P


def allowed_host_set(hosts: list[str] | None, bind_host: str, *, keyed: bool) -> frozenset[str] | None:
    """The Host names a server answers (None: any). Given `hosts` ("*" in them: any); else any host on
    a keyed server, and on an open one the bind address and the localhost names, so a page whose
    name was rebound to this machine's address cannot read the answers (DNS rebinding)."""
    if hosts:
        names = {h.strip().lower().strip("[]") for h in hosts}
        return None if "*" in names else frozenset(names)
    if keyed:
        return None
    names = {"localhost", "127.0.0.1", "::1", bind_host.lower().strip("[]")}
    return frozenset(names - {"0.0.0.0", "::", ""})


def host_name(value: str) -> str:
    """The name part of a Host header or an origin's authority: lower-case, without port or brackets."""
    value = value.strip().lower()
    if value.startswith("["):  # [::1]:8000
        return value[1:].partition("]")[0]
    name, _, port = value.rpartition(":")
    return name if name and port.isdigit() and ":" not in name else value


def check_headers(method: str, headers: dict[str, list[str]], allowed_hosts: frozenset[str] | None) -> None:
    """Refuse (APIError) what a web page could send on a user's behalf, and bodies this server
    would misread: headers maps lower-case names to every value given.

    - Host must be one of `allowed_hosts` (403; any host when None);
    - an Origin, when sent, must be this server's own (the Host header): a cross-origin page is 403;
    - a POST body must be `Content-Type: application/json` (415; a POST without a body may leave it
      out), with no Content-Encoding but identity (415).
    """
    hosts = headers.get("host", [])
    if len(hosts) > 1:
        raise P.APIError(400, "several Host headers", code="bad_host")
    host = hosts[0] if hosts else ""
    if allowed_hosts is not None and host_name(host) not in allowed_hosts:
        raise P.APIError(
            403,
            f"Host {host[:100]!r} is not served here; start the server with --allowed-host NAME to allow it",
            code="host_not_allowed",
        )
    for origin in headers.get("origin", []):
        scheme, sep, authority = origin.strip().lower().partition("://")
        if not sep or scheme not in ("http", "https") or authority.rstrip("/") != host.strip().lower():
            why = f"cross-origin requests are refused (Origin {origin[:100]!r})"
            raise P.APIError(403, why, code="origin_not_allowed")
    if method != "POST":
        return
    for encoding in headers.get("content-encoding", []):
        if encoding.strip().lower() not in ("", "identity"):
            raise P.APIError(415, f"Content-Encoding {encoding[:50]!r} is not supported; send the body as is")
    types = headers.get("content-type", [])
    has_body = headers.get("content-length", ["0"]) != ["0"] or "transfer-encoding" in headers
    if not types and not has_body:
        return
    media = types[0].partition(";")[0].strip().lower() if len(types) == 1 else ""
    if media != "application/json":
        shown = ", ".join(types)[:100] or "none"
        raise P.APIError(415, f"Content-Type must be application/json (got {shown})", code="unsupported_media_type")
