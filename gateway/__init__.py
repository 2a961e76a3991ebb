"""The aiohttp OpenAI-compatible reverse proxy that routes by cached prefix."""
