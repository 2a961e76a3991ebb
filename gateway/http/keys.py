"""The keys under which the gateway's aiohttp app holds its state, read by every handler."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from gateway.gateway import Gateway
from gateway.gateway_state import GatewayState

# The lifecycle (admin routes, health, metrics) and what requests read: requests never reach the former.
GATEWAY = web.AppKey("gateway", Gateway)
STATE = web.AppKey("state", GatewayState)
CONFIG_PATH = web.AppKey("config_path", Path)
