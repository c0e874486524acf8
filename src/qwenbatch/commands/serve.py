"""``qwenbatch serve``: the OpenAI-compatible server under uvicorn."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from qwenbatch.commands.engine_args import add_engine_args, engine_config_from_args
from qwenbatch.config import parse_bytes
from qwenbatch.loader.default_model import DEFAULT_MODEL_NAME


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register this sub-command on the top-level parser."""
    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serve the model over an OpenAI-compatible API; all requests share one engine. "
        "Flags fall back to QWENBATCH_<FLAG> environment variables (QWENBATCH_API_KEY, QWENBATCH_PORT, ...).",
    )
    env = os.environ.get
    serve.add_argument("--host", default=env("QWENBATCH_HOST", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=int(env("QWENBATCH_PORT", "8000")))
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
        default=env("QWENBATCH_API_KEY_FILE"),
        help="more keys, one a line (blank lines and lines starting with # are skipped)",
    )
    serve.add_argument(
        "--admin-api-key",
        default=env("QWENBATCH_ADMIN_API_KEY"),
        help="for POST /config (default: any of the API keys)",
    )
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=env("QWENBATCH_SERVED_MODEL_NAME", "").split() or None,
        help="the names clients use for the model (default: the --model value)",
    )
    serve.add_argument(
        "--max-waiting-seqs",
        type=int,
        default=int(env("QWENBATCH_MAX_WAITING_SEQS", "4096")),
        help="above this many waiting sequences new requests get 503 with Retry-After",
    )
    serve.add_argument(
        "--max-request-body",
        type=parse_bytes,
        default=parse_bytes(env("QWENBATCH_MAX_REQUEST_BODY", "32MiB")),
        help="largest request body, uploads to /v1/files aside (413 above it)",
    )
    serve.add_argument(
        "--data-dir",
        type=Path,
        default=env("QWENBATCH_DATA_DIR"),
        help="where /v1/files and /v1/batches keep their files and database (default: <QWENBATCH_CACHE>/server)",
    )
    serve.add_argument(
        "--max-file-bytes",
        type=parse_bytes,
        default=parse_bytes(env("QWENBATCH_MAX_FILE_BYTES", "200MB")),
        help="largest file uploaded to /v1/files (413 above it)",
    )
    serve.add_argument(
        "--max-batch-requests",
        type=int,
        default=int(env("QWENBATCH_MAX_BATCH_REQUESTS", "50000")),
        help="most requests in one batch's input file (400 above it)",
    )
    serve.add_argument(
        "--max-files-per-key",
        type=int,
        default=int(env("QWENBATCH_MAX_FILES_PER_KEY", "10000")),
        help="most files one API key may hold (uploads past it get 429)",
    )
    serve.add_argument(
        "--max-storage-per-key",
        type=parse_bytes,
        default=parse_bytes(env("QWENBATCH_MAX_STORAGE_PER_KEY", "100GB")),
        help="most bytes of files one API key may hold, batch outputs included (uploads past it get 429)",
    )
    serve.add_argument(
        "--max-open-batches-per-key",
        type=int,
        default=int(env("QWENBATCH_MAX_OPEN_BATCHES_PER_KEY", "100")),
        help="most unfinished batches one API key may have (new batches past it get 429)",
    )
    serve.add_argument(
        "--request-timeout",
        type=float,
        default=float(env("QWENBATCH_REQUEST_TIMEOUT", "60")),
        help="seconds a request's headers, and then its body, may take to arrive (an upload: the longest stall "
        "between chunks); 408 after",
    )
    serve.add_argument(
        "--max-connections",
        type=int,
        default=int(env("QWENBATCH_MAX_CONNECTIONS", "1024")),
        help="most concurrent connections and requests; more are answered 503 at once (uvicorn's limit_concurrency)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=float(env("QWENBATCH_SHUTDOWN_TIMEOUT", "30")),
        help="on SIGTERM, seconds to let in-flight requests finish",
    )
    add_engine_args(serve)
    serve.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the sub-command; returns the exit code (errors raise ValueError for a one-line message)."""
    import signal

    try:
        import uvicorn

        from qwenbatch.server.app import ServerSettings, build_app
        from qwenbatch.server.http_server import server_config
    except ImportError as e:
        raise ValueError(f"the server needs the server extra: pip install 'qwenbatch[server]' ({e})") from e

    from qwenbatch.loader import check_model_source

    if args.max_connections < 1:
        raise ValueError(f"--max-connections must be >= 1, got {args.max_connections}")
    config = engine_config_from_args(args)
    check_model_source(config.model, config.load_format)  # a bad --model fails here, not after listening
    names = args.served_model_name or ([config.model, DEFAULT_MODEL_NAME] if config.model == "default" else None)
    failures: list[BaseException] = []

    def on_fatal(error: BaseException) -> None:
        failures.append(error)
        server.should_exit = True

    settings = ServerSettings(
        served_model_names=names or [],
        api_keys=api_keys(args),
        admin_api_key=args.admin_api_key,
        max_waiting_seqs=args.max_waiting_seqs,
        max_body_bytes=args.max_request_body,
        data_dir=args.data_dir,
        max_file_bytes=args.max_file_bytes,
        max_batch_requests=args.max_batch_requests,
        max_files_per_key=args.max_files_per_key,
        max_storage_per_key=args.max_storage_per_key,
        max_open_batches_per_key=args.max_open_batches_per_key,
        on_fatal=on_fatal,
        request_timeout_s=args.request_timeout,
    )
    app = build_app(settings, config)
    server = uvicorn.Server(
        server_config(
            app,
            settings,
            host=args.host,
            port=args.port,
            timeout_graceful_shutdown=args.shutdown_timeout,
            limit_concurrency=args.max_connections,
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


def api_keys(args: argparse.Namespace) -> list[str]:
    """The --api-key values (else QWENBATCH_API_KEY's, comma-separated), then the keys in --api-key-file."""
    keys = args.api_key or [k.strip() for k in os.environ.get("QWENBATCH_API_KEY", "").split(",") if k.strip()]
    if args.api_key_file is not None:
        keys = keys + read_key_file(args.api_key_file)
    return keys


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
