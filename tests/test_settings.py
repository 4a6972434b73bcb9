"""The settings registry: environment parsing, the override context manager, unknown names."""

from __future__ import annotations

import pytest

import fusegraph as fg
from fusegraph.errors import SettingsError, UnknownSettingError
from fusegraph.settings import help_text, override, setting, settings


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FUSEGRAPH_DEBUG", "FUSEGRAPH_VERIFY", "FUSEGRAPH_DUMP_DIR", "FUSEGRAPH_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/tmp/xdg")
    assert settings.debug == 0 and settings.verify is False and settings.dump_dir == ""
    assert settings.cache_dir == "/tmp/xdg/fusegraph"


@pytest.mark.parametrize(("env", "name", "raw", "value"), [
    ("FUSEGRAPH_DEBUG", "debug", "3", 3),
    ("FUSEGRAPH_DEBUG", "debug", " 2 ", 2),
    ("FUSEGRAPH_VERIFY", "verify", "1", True),
    ("FUSEGRAPH_VERIFY", "verify", "On", True),
    ("FUSEGRAPH_VERIFY", "verify", "false", False),
    ("FUSEGRAPH_AUTOTUNE", "autotune", "0", False),
    ("FUSEGRAPH_DUMP_DIR", "dump_dir", "/tmp/dumps", "/tmp/dumps"),
    ("FUSEGRAPH_MAX_RECOMPILES", "max_recompiles", "2", 2),
])
def test_environment_variables_are_parsed(monkeypatch: pytest.MonkeyPatch, env: str, name: str, raw: str,
                                          value: object) -> None:
    monkeypatch.setenv(env, raw)
    assert getattr(settings, name) == value
    assert type(getattr(settings, name)) is type(value)


def test_an_empty_environment_variable_means_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEGRAPH_DEBUG", "")
    assert settings.debug == 0


@pytest.mark.parametrize(("env", "raw", "name"), [
    ("FUSEGRAPH_DEBUG", "lots", "debug"),
    ("FUSEGRAPH_VERIFY", "maybe", "verify"),
])
def test_bad_environment_values_are_typed_errors_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch, env: str, raw: str, name: str) -> None:
    monkeypatch.setenv(env, raw)
    with pytest.raises(SettingsError, match=rf"setting {name} \(environment variable {env}\): cannot read "
                                            rf"'{raw}'"):
        getattr(settings, name)
    assert issubclass(SettingsError, fg.FusegraphError)


def test_override_wins_over_the_environment_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEGRAPH_DEBUG", "1")
    with override(debug=4, verify=True):
        assert settings.debug == 4 and settings.verify is True
        with override(debug="2"):                      # strings parse like the environment
            assert settings.debug == 2
        assert settings.debug == 4
    assert settings.debug == 1 and settings.verify is False


def test_override_restores_after_an_exception() -> None:
    with pytest.raises(RuntimeError), override(debug=3):
        raise RuntimeError("inside")
    assert settings.debug == 0


def test_override_checks_types() -> None:
    with pytest.raises(SettingsError, match=r"setting debug \(override\): expected int, got float"), \
            override(debug=1.5):
        pass
    with pytest.raises(SettingsError, match="expected int, got bool"), override(debug=True):
        pass
    with pytest.raises(SettingsError, match="cannot read 'x' as bool"), override(verify="x"):
        pass


def test_unknown_names_raise_listing_the_known_ones() -> None:
    with pytest.raises(UnknownSettingError, match=r"unknown setting 'debgu'; known: .*debug"):
        _ = settings.debgu
    with pytest.raises(UnknownSettingError, match="unknown setting 'nope'"), override(nope=1):
        pass
    assert not hasattr(settings, "nope")                 # also an AttributeError
    with pytest.raises(UnknownSettingError):
        setting("nope")


def test_settings_are_read_only() -> None:
    with pytest.raises(SettingsError, match=r"read-only.*override"):
        settings.debug = 3


def test_help_lists_every_setting_with_its_variable_and_debug_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FUSEGRAPH_DEBUG", raising=False)
    text = help_text()
    for name, env, _value, helptext in settings.describe():
        assert env in text and helptext in text and env == "FUSEGRAPH_" + name.upper()
    assert "FUSEGRAPH_DEBUG (int, now 0)" in text
    assert "4 + the graph after every pass" in text
    assert set(dir(settings)) >= {"debug", "dump_dir", "cache_dir", "verify"}
