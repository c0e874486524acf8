"""One way to configure: flags > --config file > QWENBATCH_* environment > defaults, with one-line errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from qwenbatch import LLM
from qwenbatch.cli import build_parser, main
from qwenbatch.commands.engine_args import engine_config_from_args
from qwenbatch.commands.serve import api_keys, serve_options, server_settings_values
from qwenbatch.config import EngineConfig
from qwenbatch.settings import resolve


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "qwenbatch.toml"
    path.write_text(text)
    return path


# -- precedence -------------------------------------------------------------------------------------

LAYERS = ["default", "env", "file", "flag"]
VALUES = {"env": "7", "file": "8", "flag": "9"}


def layered_argv(tmp_path, monkeypatch, table: str, name: str, top: str, command: list[str]) -> list[str]:
    """``command`` with ``name`` set to VALUES' own value in every layer from the environment up to ``top``."""
    layers = LAYERS[1 : LAYERS.index(top) + 1]
    if "env" in layers:
        monkeypatch.setenv("QWENBATCH_" + name.upper(), VALUES["env"])
    argv = list(command)
    if "file" in layers:
        argv += ["--config", str(write_config(tmp_path, f"[{table}]\n{name} = {VALUES['file']}\n"))]
    if "flag" in layers:
        argv += ["--" + name.replace("_", "-"), VALUES["flag"]]
    return argv


# "default": unset, for the engine's device to resolve (256 on the CPU, more on a large GPU).
@pytest.mark.parametrize(("top", "expected"), [("default", None), ("env", 7), ("file", 8), ("flag", 9)])
def test_an_engine_field_comes_from_the_highest_layer_that_sets_it(tmp_path, monkeypatch, top, expected):
    command = ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl"]
    argv = layered_argv(tmp_path, monkeypatch, "engine", "max_num_seqs", top, command)
    assert engine_config_from_args(parse(*argv)).max_num_seqs == expected


@pytest.mark.parametrize(("top", "expected"), [("default", 1024), ("env", 7), ("file", 8), ("flag", 9)])
def test_a_server_field_comes_from_the_highest_layer_that_sets_it(tmp_path, monkeypatch, top, expected):
    argv = layered_argv(tmp_path, monkeypatch, "server", "max_connections", top, ["serve"])
    assert serve_options(parse(*argv)).max_connections == expected


def test_serve_reads_both_tables_of_one_file_and_run_batch_only_the_engine_table(tmp_path):
    path = write_config(
        tmp_path, '[engine]\nmax_num_seqs = 5\n\n[server]\nmax_request_body = "64MiB"\napi_key = ["a", "b"]\n'
    )
    serve = parse("serve", "--config", str(path))
    assert serve_options(serve).max_request_body == 64 * 2**20
    assert serve_options(serve).api_key == ["a", "b"]
    assert engine_config_from_args(serve).max_num_seqs == 5
    batch = parse("run-batch", "-i", "in", "-o", "out", "--config", str(path))
    assert engine_config_from_args(batch).max_num_seqs == 5


def test_server_settings_get_the_options_under_their_names_and_keep_their_defaults(tmp_path, monkeypatch):
    from qwenbatch.server.app import ServerSettings  # the server extra

    monkeypatch.setenv("QWENBATCH_MAX_REQUEST_BODY", "1MiB")
    monkeypatch.setenv("QWENBATCH_REQUEST_TIMEOUT", "2.5")
    options = serve_options(parse("serve", "--data-dir", str(tmp_path)))
    settings = ServerSettings(**server_settings_values(options))
    assert (settings.max_body_bytes, settings.request_timeout_s, settings.data_dir) == (2**20, 2.5, tmp_path)
    assert settings.max_waiting_seqs == ServerSettings().max_waiting_seqs  # not given: ServerSettings' own default


def test_environment_lists_keep_their_separators(monkeypatch, tmp_path):
    key_file = tmp_path / "keys.txt"
    key_file.write_text("key-c\n")
    monkeypatch.setenv("QWENBATCH_API_KEY", "env-1, env-2,")
    monkeypatch.setenv("QWENBATCH_SERVED_MODEL_NAME", "qwen3  qwen3-0.6b")
    monkeypatch.setenv("QWENBATCH_API_KEY_FILE", str(key_file))
    options = serve_options(parse("serve"))
    assert options.served_model_name == ["qwen3", "qwen3-0.6b"]
    assert options.api_key_file == key_file
    assert api_keys(options) == ["env-1", "env-2", "key-c"]
    assert api_keys(serve_options(parse("serve", "--api-key", "flag-key"))) == ["flag-key", "key-c"]


def test_an_empty_environment_variable_is_unset(monkeypatch):
    monkeypatch.setenv("QWENBATCH_PORT", "")
    monkeypatch.setenv("QWENBATCH_MAX_NUM_SEQS", " ")
    assert serve_options(parse("serve")).port == 8000
    assert engine_config_from_args(parse("serve")).max_num_seqs is None  # unset: the device's default


@pytest.mark.parametrize(
    ("variable", "text", "value"),
    [
        ("QWENBATCH_ENFORCE_EAGER", "on", True),
        ("QWENBATCH_ENABLE_PREFIX_CACHING", "0", False),
        ("QWENBATCH_GPU_MEMORY_UTILIZATION", "0.5", 0.5),
        ("QWENBATCH_KV_CACHE_MEMORY", "0.25", 0.25),
        ("QWENBATCH_KV_CACHE_MEMORY", "16MiB", 16 * 2**20),
        ("QWENBATCH_MAX_MODEL_LEN", "512", 512),
        ("QWENBATCH_TOKENIZER", "default", "default"),
    ],
)
def test_engine_fields_read_environment_text_by_their_type(monkeypatch, variable, text, value):
    monkeypatch.setenv(variable, text)
    config = engine_config_from_args(parse("serve", "--device", "cpu"))  # a fraction of KV memory is CPU-only
    assert getattr(config, variable.removeprefix("QWENBATCH_").lower()) == value


# -- one-line errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "text", "expected"),
    [
        ("QWENBATCH_MAX_NUM_SEQS", "abc", "expected an integer"),
        ("QWENBATCH_MAX_MODEL_LEN", "1.5", "expected an integer"),
        ("QWENBATCH_GPU_MEMORY_UTILIZATION", "most", "expected a number"),
        ("QWENBATCH_ENFORCE_EAGER", "maybe", "expected true or false"),
        ("QWENBATCH_KV_CACHE_MEMORY", "lots", "expected a size in bytes"),
        ("QWENBATCH_PORT", "80a", "expected an integer"),
        ("QWENBATCH_REQUEST_TIMEOUT", "soon", "expected a number"),
        ("QWENBATCH_MAX_REQUEST_BODY", "lots", "expected a size in bytes"),
    ],
)
def test_a_bad_environment_value_is_one_line_naming_the_variable(monkeypatch, variable, text, expected):
    monkeypatch.setenv(variable, text)
    args = parse("serve")
    with pytest.raises(ValueError) as error:
        engine_config_from_args(args)  # the engine's variables
        serve_options(args)  # the server's
    message = str(error.value)
    assert message.startswith(f"{variable}={text!r}: {expected}")
    assert "\n" not in message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[server]\nport = "80a"\n', "[server] port='80a': expected an integer"),
        ("[server]\nport = 80.5\n", "[server] port=80.5: expected an integer"),
        ("[server]\nmax_connections = true\n", "[server] max_connections=True: expected an integer"),
        ('[server]\nmax_file_bytes = "big"\n', "[server] max_file_bytes='big': expected a size in bytes"),
        ("[server]\napi_key = [1]\n", "[server] api_key=[1]: expected comma-separated values"),
        ("[server]\nprot = 1\n", "unknown server setting 'prot'"),
        ("[serve]\nport = 1\n", "unknown table(s) serve"),
        ("server = 1\n", "server must be a table"),
    ],
)
def test_a_bad_server_table_is_one_line_naming_the_file_and_key(tmp_path, text, message):
    path = write_config(tmp_path, text)
    with pytest.raises(ValueError) as error:
        serve_options(parse("serve", "--config", str(path)))
    assert str(error.value).startswith(f"--config {path}: ")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_generate_help_ignores_the_server_environment(monkeypatch, capsys):
    monkeypatch.setenv("QWENBATCH_PORT", "80a")
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code == 0
    assert "--max-tokens" in capsys.readouterr().out


def test_serve_with_a_bad_environment_value_exits_2_with_one_line(monkeypatch, capsys):
    monkeypatch.setenv("QWENBATCH_PORT", "80a")
    assert main(["serve"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "qwenbatch: error: QWENBATCH_PORT='80a': expected an integer\n"


def test_a_field_of_a_type_without_a_form_is_a_programming_error():
    @dataclass
    class Odd:
        table: dict[str, int] = field(default_factory=dict)

    with pytest.raises(TypeError, match=r"Odd\.table"):
        resolve(Odd, {}, None, "engine", env={})


# -- the Python API takes the CLI's text ------------------------------------------------------------


def test_engine_config_takes_a_kv_cache_size_as_text():
    assert EngineConfig(kv_cache_memory="64MiB").kv_cache_memory == 64 * 2**20
    assert EngineConfig(kv_cache_memory="0.5", device="cpu").kv_cache_memory == 0.5
    with pytest.raises(ValueError, match="size in bytes"):
        EngineConfig(kv_cache_memory="lots")


def test_llm_takes_a_kv_cache_size_as_text(tiny_qwen2):
    llm = LLM(model=str(tiny_qwen2), dtype="float32", kv_cache_memory="16MiB")
    assert llm.config.kv_cache_memory == 16 * 2**20
