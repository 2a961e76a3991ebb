"""The keys under which the gateway's aiohttp app holds its state, read by every handler."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from gateway.gateway import Gateway

GATEWAY = web.AppKey("gateway", Gateway)
CONFIG_PATH = web.AppKey("config_path", Path)
