"""--structured-outputs-config: vLLM's keys and dotted flags; what lbd does not ship is refused, exit 2."""

from __future__ import annotations

import pytest

from lbd.engine.config.args import parse_engine_args, structured_config


def test_json_and_dotted_flags_merge() -> None:
    assert structured_config(parse_engine_args([])).library == "xgrammar"  # auto
    cfg = structured_config(parse_engine_args(["--structured-outputs-config", '{"backend": "guidance"}',
                                               "--structured-outputs-config.disable_any_whitespace", "true"]))
    assert (cfg.library, cfg.disable_any_whitespace) == ("guidance", True)
    cfg = structured_config(parse_engine_args(["--structured-outputs-config", '{"backend": "guidance"}',
                                               "--structured-outputs-config.backend", "xgrammar"]))
    assert cfg.library == "xgrammar"  # the dotted flag wins


@pytest.mark.parametrize("argv, words", [
    (["--structured-outputs-config.backend", "outlines"], "not shipped"),
    (["--structured-outputs-config", '{"backend": "lm-format-enforcer"}'], "not shipped"),
    (["--structured-outputs-config", '{"reasoning_parser": "deepseek_r1"}'], "reasoning"),
    (["--structured-outputs-config", '{"bakend": "xgrammar"}'], "unknown keys"),
    (["--structured-outputs-config", "{oops"], "not valid JSON"),
    (["--structured-outputs-config.disable_additional_properties", "true"], "guidance"),
])
def test_refused_with_exit_2(argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_engine_args(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err
