"""The variables the ranks read are in the help of the commands that start ranks, and of allreduce itself."""

from __future__ import annotations

import pytest

from allreduce.cli._main import main

VARIABLES = ("ALLREDUCE_STATS", "ALLREDUCE_TRACE", "ALLREDUCE_INJECT")


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["bench", "--help"]], ids=" ".join)
def test_help_names_the_recording_tracing_and_injection_variables(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    out = capsys.readouterr().out
    for variable in VARIABLES:
        assert f"\n  {variable} " in out, variable


def test_run_help_says_python_is_this_interpreter(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "A COMMAND of python or python3 runs as this interpreter" in capsys.readouterr().out
