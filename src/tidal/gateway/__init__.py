"""tidal.gateway: the OpenAI-compatible recording gateway (see docs/gateway.md).

Modules: `family` (model-family table), `toolcalls` (parsing), `messages` (request
parsing), `render` (template blocks), `tito` (token-in-token-out prompt assembly),
`drift` (classification), `core` (one request -> one recorded call), `server` (HTTP,
`GatewayServer`), `verify` (the fidelity audit), `cli` (`tidal serve`, `tidal verify`).

`GatewayServer` is imported lazily so that importing the package does not load uvicorn.
"""

from __future__ import annotations

from typing import Any

from tidal.gateway.core import Gateway, Route
from tidal.gateway.verify import VerifyReport, verify_store

__all__ = ["Gateway", "GatewayServer", "Route", "VerifyReport", "verify_store"]


def __getattr__(name: str) -> Any:
    if name == "GatewayServer":
        from tidal.gateway.server import GatewayServer

        return GatewayServer
    raise AttributeError(name)
