"""raystate.serve: the OpenAI-compatible HTTP API on Ray Serve.

`build_app(args)` is the Serve application (`import_path: raystate.serve.app:build_app`); `make_app(args,
client_factory)` injects another client. Both load on first use, so that importing the protocol or the
server (which never touch Ray Serve) stays light.
"""

__all__ = ["build_app", "make_app"]


def __getattr__(name: str):
    if name in __all__:
        from raystate.serve import app

        return getattr(app, name)
    raise AttributeError(f"module 'raystate.serve' has no attribute {name!r}")
