"""The router: OpenAI-compatible front door of a PD cluster (docs/design.md §10).

Entry points: `app.create_router_app(config)`, `server.run_router(config)`,
`config.RouterConfig`. The package itself imports nothing, so the pure
modules (rooms, policies, discovery, ...) load without the HTTP stack.
"""
