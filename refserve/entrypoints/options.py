"""`ServerOptions`: every knob of the HTTP server (not the engine's), checked once.

| knob | default | meaning |
| --- | --- | --- |
| host, port | 127.0.0.1, 8000 | where to listen; loopback unless told otherwise |
| api_key | None | every /v1/* route needs `Authorization: Bearer <key>` (401 otherwise) |
| allowed_hosts | None | Host names answered; None: loopback ones on a loopback bind, else any |
| docs | True | serve /docs, /redoc and /openapi.json |
| max_request_bytes | 8 MiB | a longer body is refused with 413 before it is read |
| max_prompts_per_request | 256 | a longer `prompt` list is refused with 400 |
| max_logprobs | 20 | most `logprobs` / `top_logprobs` a request may ask for (vLLM's default) |
| header_timeout | 10 s | a whole request head must arrive this soon after the connection opens |
| body_timeout | 60 s | the whole body must arrive this soon after the head (408 otherwise) |
| keep_alive_timeout | 5 s | an idle keep-alive connection is closed after this long (uvicorn's) |
| limit_concurrency | 512 | connections + tasks at once; beyond it uvicorn answers 503 |
| shutdown_timeout | 10 s | on SIGTERM / SIGINT, how long running requests may still finish |

(header_timeout restarts after each response of a keep-alive connection.)

The limits exist so that no single client can hold the server: one huge body, a slow client
sending a byte a second, or a flood of idle connections each costs a bounded amount.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from refserve.sampling_params import MAX_LOGPROBS

MiB = 1024 * 1024


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, maybe in [brackets]) names this machine only:
    localhost, a *.localhost name (RFC 6761) or a loopback address (127.0.0.0/8, ::1)."""
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] | None = None
    docs: bool = True
    max_request_bytes: int = 8 * MiB
    max_prompts_per_request: int = 256
    max_logprobs: int = MAX_LOGPROBS
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    keep_alive_timeout: float = 5.0
    limit_concurrency: int = 512
    shutdown_timeout: float = 10.0

    def __post_init__(self) -> None:
        """Raises ValueError naming the knob (the CLI turns it into an `error:` line)."""
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port}: must be in 0..65535")
        for name in ("max_request_bytes", "max_prompts_per_request", "limit_concurrency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} {value!r}: must be an integer >= 1")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs {self.max_logprobs}: must be in 0..{MAX_LOGPROBS}"
                             " (SamplingParams' cap, vLLM's default max_logprobs)")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} {getattr(self, name)!r}: must be > 0 seconds")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout {self.shutdown_timeout!r}: must be >= 0 "
                             "seconds")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key is empty; give a key or leave it out")
        if self.allowed_hosts is not None:
            self.allowed_hosts = tuple(h.strip().lower() for h in self.allowed_hosts)

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    def exposure_warning(self) -> str | None:
        """What to print at start-up when anyone on the network can use the server."""
        if self.loopback or self.api_key is not None:
            return None
        return (f"WARNING: listening on {self.host} without an API key: anyone who can reach "
                "this port can use the server (set --api-key or $REFSERVE_API_KEY)")

    def host_allowed(self, host_header: str | None) -> bool:
        """DNS rebinding defence: a page on evil.example can make the browser resolve
        evil.example to 127.0.0.1 and talk to this server, but the browser still sends
        `Host: evil.example`. So a loopback-bound server answers loopback names only, as
        Jupyter does; `allowed_hosts` widens that ("*": any). No Host header at all (HTTP/1.0)
        cannot come from a browser and is let through."""
        if host_header is None:
            return True
        name = _strip_port(host_header.strip().lower())
        if self.allowed_hosts is not None:
            return "*" in self.allowed_hosts or name in self.allowed_hosts or (
                self.loopback and is_loopback(name))
        return not self.loopback or is_loopback(name)


def _strip_port(host: str) -> str:
    if host.startswith("["):                  # [::1]:8000
        return host[:host.find("]") + 1] if "]" in host else host
    if host.count(":") == 1:                  # name:8000 (an IPv6 literal has several)
        return host.split(":", 1)[0]
    return host
