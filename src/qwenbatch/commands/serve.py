"""``qwenbatch serve``: the OpenAI-compatible server under uvicorn."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qwenbatch.commands.engine_args import add_engine_args, engine_config_from_args
from qwenbatch.loader.default_model import DEFAULT_MODEL_NAME
from qwenbatch.settings import BYTES, WORDS, parse_bytes, read_as, resolve


@dataclass
class ServeOptions:
    """The serve flags' values, named as the flags; each from its flag, the [server] table of --config,
    ``QWENBATCH_<NAME>`` or the default here. None leaves the setting to ServerSettings' default."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: list[str] = field(default_factory=list)  # QWENBATCH_API_KEY: comma-separated
    api_key_file: Path | None = None
    admin_api_key: str | None = None
    served_model_name: list[str] = field(default_factory=list, metadata=read_as(WORDS))
    max_waiting_seqs: int | None = None
    max_request_body: int | None = field(default=None, metadata=read_as(BYTES))
    data_dir: Path | None = None
    max_file_bytes: int | None = field(default=None, metadata=read_as(BYTES))
    max_batch_requests: int | None = None
    max_files_per_key: int | None = None
    max_storage_per_key: int | None = field(default=None, metadata=read_as(BYTES))
    max_open_batches_per_key: int | None = None
    request_timeout: float | None = None
    max_connections: int = 1024
    shutdown_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")


# The options ServerSettings takes, under its own names.
SERVER_SETTINGS_NAMES = {
    "admin_api_key": "admin_api_key",
    "max_waiting_seqs": "max_waiting_seqs",
    "max_request_body": "max_body_bytes",
    "data_dir": "data_dir",
    "max_file_bytes": "max_file_bytes",
    "max_batch_requests": "max_batch_requests",
    "max_files_per_key": "max_files_per_key",
    "max_storage_per_key": "max_storage_per_key",
    "max_open_batches_per_key": "max_open_batches_per_key",
    "request_timeout": "request_timeout_s",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register this sub-command on the top-level parser."""
    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serve the model over an OpenAI-compatible API; all requests share one engine. "
        "A flag not given falls back to the [server] table of --config (keys named as the flags: max_request_body), "
        "then to a QWENBATCH_<FLAG> environment variable (QWENBATCH_PORT, QWENBATCH_API_KEY, ...).",
    )
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument(
        "--api-key",
        action="append",
        type=str.strip,
        help="require this bearer token; repeat for several keys, each with its own files and batches "
        "(default: QWENBATCH_API_KEY, comma-separated)",
    )
    serve.add_argument(
        "--api-key-file",
        type=Path,
        help="more keys, one a line (blank lines and lines starting with # are skipped)",
    )
    serve.add_argument(
        "--admin-api-key",
        help="for POST /config (default: any of the API keys)",
    )
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        help="the names clients use for the model (default: the --model value)",
    )
    serve.add_argument(
        "--max-waiting-seqs",
        type=int,
        help="above this many waiting sequences new requests get 503 with Retry-After",
    )
    serve.add_argument(
        "--max-request-body",
        type=parse_bytes,
        help="largest request body, uploads to /v1/files aside (413 above it)",
    )
    serve.add_argument(
        "--data-dir",
        type=Path,
        help="where /v1/files and /v1/batches keep their files and database (default: <QWENBATCH_CACHE>/server)",
    )
    serve.add_argument(
        "--max-file-bytes",
        type=parse_bytes,
        help="largest file uploaded to /v1/files (413 above it)",
    )
    serve.add_argument(
        "--max-batch-requests",
        type=int,
        help="most requests in one batch's input file (400 above it)",
    )
    serve.add_argument(
        "--max-files-per-key",
        type=int,
        help="most files one API key may hold (uploads past it get 429)",
    )
    serve.add_argument(
        "--max-storage-per-key",
        type=parse_bytes,
        help="most bytes of files one API key may hold, batch outputs included (uploads past it get 429)",
    )
    serve.add_argument(
        "--max-open-batches-per-key",
        type=int,
        help="most unfinished batches one API key may have (new batches past it get 429)",
    )
    serve.add_argument(
        "--request-timeout",
        type=float,
        help="seconds a request's headers, and then its body, may take to arrive (an upload: the longest stall "
        "between chunks); 408 after",
    )
    serve.add_argument(
        "--max-connections",
        type=int,
        help="most concurrent connections and requests; more are answered 503 at once (uvicorn's limit_concurrency)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        help="on SIGTERM, seconds to let in-flight requests finish",
    )
    add_engine_args(serve)
    serve.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the sub-command; returns the exit code (errors raise ValueError for a one-line message)."""
    import signal

    options = serve_options(args)
    try:
        import uvicorn

        from qwenbatch.server.app import ServerSettings, build_app
        from qwenbatch.server.http_server import server_config
    except ImportError as e:
        raise ValueError(f"the server needs the server extra: pip install 'qwenbatch[server]' ({e})") from e

    from qwenbatch.loader import check_model_source

    config = engine_config_from_args(args)
    check_model_source(config.model, config.load_format)  # a bad --model fails here, not after listening
    default_names = [config.model, DEFAULT_MODEL_NAME] if config.model == "default" else []
    failures: list[BaseException] = []

    def on_fatal(error: BaseException) -> None:
        failures.append(error)
        server.should_exit = True

    settings = ServerSettings(
        served_model_names=options.served_model_name or default_names,
        api_keys=api_keys(options),
        on_fatal=on_fatal,
        **server_settings_values(options),
    )
    app = build_app(settings, config)
    server = uvicorn.Server(
        server_config(
            app,
            settings,
            host=options.host,
            port=options.port,
            timeout_graceful_shutdown=options.shutdown_timeout,
            limit_concurrency=options.max_connections,
            log_level="debug" if args.verbose else "info",
        )
    )
    # uvicorn re-raises the signal it stopped on once it has drained; a handler that does nothing
    # turns that into a normal exit (0) after the graceful shutdown.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    if failures:
        print(f"qwenbatch: error: {failures[0]}", file=sys.stderr)
        return 1
    return 0


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """The serve flags, else the [server] table of --config, else QWENBATCH_* variables, else the defaults;
    ValueError naming a bad variable, key or value."""
    return resolve(ServeOptions, vars(args), args.config, "server")


def server_settings_values(options: ServeOptions) -> dict[str, Any]:
    """The options ServerSettings takes, under its names; those not set are left to its defaults."""
    values = {name: getattr(options, option) for option, name in SERVER_SETTINGS_NAMES.items()}
    return {name: value for name, value in values.items() if value is not None}


def api_keys(options: ServeOptions) -> list[str]:
    """The --api-key values (else the file's or QWENBATCH_API_KEY's), then the keys in --api-key-file."""
    if options.api_key_file is None:
        return options.api_key
    return options.api_key + read_key_file(options.api_key_file)


def read_key_file(path: Path) -> list[str]:
    """One key a line, blank lines and ``#`` comment lines skipped; ValueError if unreadable or empty."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read the API key file {path}: {e.strerror}") from e
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        # An empty file must not silently leave the server open to anyone.
        raise ValueError(f"the API key file {path} holds no keys")
    return keys
