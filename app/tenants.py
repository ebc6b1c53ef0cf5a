"""Who a request is for: the tenant its API key names (app/api/middleware.py sets it), carried in a context
variable so the engine and the service read it without being handed the HTTP request."""
from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class Tenant:
    """Who a request is for: the name its API key maps to (server.api_keys; "" is the default tenant: the single
    server.api_key, or a server without keys)."""

    name: str = ""
    admin: bool = True  # may read /metrics and the global counters (server.admin_keys; every caller without keys)

    @property
    def label(self) -> str:  # in metrics
        return self.name or "default"


# The tenant of the request being served, set for the whole request (its handlers, the threads they start and
# its streamed body inherit it).
TENANT: ContextVar[Tenant] = ContextVar("ragblend_tenant", default=Tenant())
TENANT_SCOPE_KEY = "ragblend.tenant"  # ... and in the ASGI scope, for the middleware outside (request counting)


def current_tenant() -> Tenant:
    return TENANT.get()
