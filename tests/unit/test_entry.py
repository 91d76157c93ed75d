"""The ``tokenfleet`` command's entry point (``tokenfleet.entry``)."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from types import ModuleType

import pytest

from tokenfleet.entry import EXIT_INTERRUPTED, run


class _CtrlCWhileLoading(importlib.abc.MetaPathFinder):
    """Ctrl-C arriving while ``tokenfleet.cli`` is imported."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> None:
        if fullname == "tokenfleet.cli":
            raise KeyboardInterrupt
        return None


def test_a_ctrl_c_while_the_cli_loads_ends_with_interrupted_and_exit_130_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delitem(sys.modules, "tokenfleet.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_CtrlCWhileLoading(), *sys.meta_path])

    assert run() == EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_once_loaded_the_command_runs_and_its_exit_code_is_returned(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["tokenfleet", "--version"])
    with pytest.raises(SystemExit) as exited:  # argparse's --version exits itself
        run()
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip()
