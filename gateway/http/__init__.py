"""The gateway's HTTP surface: the app and its route table, the OpenAI handlers, admin and debug views,
middleware, and the OpenAPI document of the routes it serves."""
