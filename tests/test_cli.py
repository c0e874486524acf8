"""`qwenbatch generate` in-process: output on stdout, one-line errors with exit code 2, help; and a start in a
fresh process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qwenbatch import LLM, SamplingParams
from qwenbatch.cli import main

MAX_TOKENS = 6
PROMPTS = ["The quick brown fox", "Python is", "用一句话介绍Python"]


@pytest.fixture(scope="module")
def engine_flags(tiny_qwen2) -> list[str]:
    return [
        "--model",
        str(tiny_qwen2),
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "16MiB",
        "--max-tokens",
        str(MAX_TOKENS),
    ]


@pytest.fixture(scope="module")
def reference(tiny_qwen2) -> LLM:
    """The same model through the Python API, to say what the CLI must print."""
    return LLM(model=str(tiny_qwen2), dtype="float32", kv_cache_memory=16 * 2**20)


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_prompt_prints_its_completion(capsys, engine_flags, reference):
    code, out, err = run(capsys, ["generate", PROMPTS[0], *engine_flags])
    assert code == 0, err
    expected = reference.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].text
    assert out == expected + "\n"


def test_input_file_prints_one_line_per_prompt_in_order(capsys, engine_flags, reference, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    code, out, err = run(capsys, ["generate", "--input", str(path), *engine_flags])
    assert code == 0, err
    lines = out.split("\n")
    assert lines[-1] == ""  # ends with a newline
    outputs = reference.generate(PROMPTS, GREEDY, use_tqdm=False)
    expected = [o.outputs[0].text.replace("\n", "\\n") for o in outputs]
    assert lines[:-1] == expected


def test_chat_wraps_the_prompt_in_the_template(capsys, engine_flags, reference):
    code, out, err = run(capsys, ["generate", "--chat", "--system", "Be brief.", "你好", *engine_flags])
    assert code == 0, err
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}]
    expected = reference.chat(messages, GREEDY, use_tqdm=False)[0].outputs[0].text
    assert out == expected + "\n"


def test_chat_no_thinking(capsys, engine_flags, reference):
    code, out, err = run(capsys, ["generate", "--chat", "--no-thinking", "你好", *engine_flags])
    assert code == 0, err
    messages = [{"role": "user", "content": "你好"}]
    expected = reference.chat(messages, GREEDY, enable_thinking=False, use_tqdm=False)[0].outputs[0].text
    assert out == expected + "\n"


def assert_one_line_error(err: str, *fragments: str) -> None:
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("qwenbatch: error: ")]
    assert len(errors) == 1, err
    for fragment in fragments:
        assert fragment in errors[0]


def test_missing_model_path(capsys, tmp_path):
    missing = tmp_path / "no-such-model"
    code, out, err = run(capsys, ["generate", "hi", "--model", str(missing), "--kv-cache-memory", "16MiB"])
    assert code == 2
    assert out == ""
    assert_one_line_error(err, str(missing))


def test_prompt_and_input_together(capsys, engine_flags, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("hello\n", encoding="utf-8")
    code, out, err = run(capsys, ["generate", "hi", "--input", str(path), *engine_flags])
    assert code == 2
    assert out == ""
    assert_one_line_error(err, "--input")


def test_neither_prompt_nor_input(capsys, engine_flags):
    code, _, err = run(capsys, ["generate", *engine_flags])
    assert code == 2
    assert_one_line_error(err, "--input")


def test_empty_input_file(capsys, engine_flags, tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("\n  \n", encoding="utf-8")
    code, out, err = run(capsys, ["generate", "--input", str(path), *engine_flags])
    assert code == 2
    assert out == ""
    assert_one_line_error(err, str(path))


def test_missing_input_file(capsys, engine_flags, tmp_path):
    path = tmp_path / "absent.txt"
    code, _, err = run(capsys, ["generate", "--input", str(path), *engine_flags])
    assert code == 2
    assert_one_line_error(err, str(path))


def test_invalid_temperature(capsys, engine_flags):
    code, out, err = run(capsys, ["generate", "hi", "--temperature", "-1", *engine_flags])
    assert code == 2
    assert out == ""
    assert_one_line_error(err, "temperature")


def test_invalid_kv_cache_size_is_a_usage_error(capsys, tiny_qwen2):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--model", str(tiny_qwen2), "--kv-cache-memory", "lots"])
    assert exc.value.code == 2
    assert "--kv-cache-memory" in capsys.readouterr().err


def test_top_level_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage: qwenbatch" in out
    assert "generate" in out


def test_generate_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--input",
        "--chat",
        "--no-thinking",
        "--max-tokens",
        "--temperature",
        "--top-p",
        "--top-k",
        "--stop",
        "--model",
        "--dtype",
        "--kv-cache-memory",
        "--max-model-len",
        "--seed",
    ):
        assert flag in out


def test_quantization_int8_generates_and_a_bad_value_is_a_usage_error(capsys, engine_flags):
    code, out, err = run(capsys, ["generate", PROMPTS[0], *engine_flags, "--quantization", "int8"])
    assert code == 0, err
    assert out.strip()
    with pytest.raises(SystemExit) as exc:
        main(["generate", PROMPTS[0], *engine_flags, "--quantization", "int4"])
    assert exc.value.code == 2
    assert "--quantization" in capsys.readouterr().err


def test_a_run_without_compile_never_imports_the_compiler(engine_flags):
    """torch._dynamo costs ~2.4 s of every start (of ~5 s to the first step of a small model): the CLI and an
    engine that does not compile must not import it (a decorator on a module's method and the random init of
    layers on the meta device once did)."""
    code = (
        "import sys; from qwenbatch.cli import main; "
        f"assert main(['generate', 'hi', '--max-tokens', '2', *{engine_flags!r}]) == 0; "
        "print('torch._dynamo' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
