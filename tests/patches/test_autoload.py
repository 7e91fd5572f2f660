"""The post-import hook that defers every patch (``_hf_fp8_autoload``), on throwaway modules."""

from __future__ import annotations

import sys
from contextlib import contextmanager

import pytest

import _hf_fp8_autoload as autoload


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """``write(name, source)`` creates an importable module under a fresh folder."""
    monkeypatch.syspath_prepend(str(tmp_path))
    created = []

    def write(name: str, source: str = "VALUE = 1\n") -> str:
        (tmp_path / f"{name}.py").write_text(source)
        created.append(name)
        return name

    yield write
    for name in created:
        sys.modules.pop(name, None)
        autoload._AFTER.pop(name, None)
        autoload._AROUND.pop(name, None)
        autoload._PENDING.discard(name)
        autoload._EXECUTED.discard(name)


def test_callback_runs_after_the_module_executed(modules):
    name = modules("h4_mod_after")
    seen = []
    autoload.when_imported(name, lambda m: seen.append(m.VALUE))
    assert seen == []
    __import__(name)
    assert seen == [1]
    autoload.when_imported(name, lambda m: seen.append("now"))  # already imported: at once
    assert seen == [1, "now"]


def test_around_wraps_the_execution(modules):
    name = modules("h4_mod_around", "import h4_probe\nh4_probe.events.append('exec')\n")
    probe = type(sys)("h4_probe")
    probe.events = []
    sys.modules["h4_probe"] = probe

    @contextmanager
    def around():
        probe.events.append("enter")
        yield
        probe.events.append("exit")

    try:
        autoload.around_import(name, around)
        __import__(name)
    finally:
        del sys.modules["h4_probe"]
    assert probe.events == ["enter", "exec", "exit"]


def test_a_failing_callback_warns_and_the_import_succeeds(modules):
    name = modules("h4_mod_fail")

    def boom(module):
        raise RuntimeError("broken patch")

    autoload.when_imported(name, boom)
    with pytest.warns(UserWarning, match="broken patch"):
        module = __import__(name)
    assert module.VALUE == 1


def test_watch_set_while_the_module_imports_runs_when_it_is_done(modules):
    """A watch set half-way through the module's own import (not through the hook's loader)
    runs at the next import once the module has finished."""
    later = modules("h4_mod_later")
    probe = type(sys)("h4_probe")
    probe.seen = []
    name = modules(
        "h4_mod_half",
        "import _hf_fp8_autoload, h4_probe\n"
        "_hf_fp8_autoload.when_imported(__name__, lambda m: h4_probe.seen.append(m.DONE))\n"
        "DONE = 'yes'\n",
    )
    sys.modules["h4_probe"] = probe
    try:
        __import__(name)
        assert probe.seen == [] and name in autoload._PENDING
        __import__(later)  # any import checks the pending watches
    finally:
        del sys.modules["h4_probe"]
    assert probe.seen == ["yes"]


def test_a_watched_module_runs_a_callback_set_half_way_when_it_is_done(modules):
    """Watched from the start (what the autoload does for every patch trigger), a module that
    gets a callback half-way through its own import runs it as soon as it finishes, with no
    further import (R8 4: TrainingArguments lacked the optimizer names until the next import)."""
    probe = type(sys)("h4_probe")
    probe.seen = []
    name = modules(
        "h4_mod_watched",
        "import _hf_fp8_autoload, h4_probe\n"
        "_hf_fp8_autoload.when_imported(__name__, lambda m: h4_probe.seen.append(m.DONE))\n"
        "DONE = 'yes'\n",
    )
    sys.modules["h4_probe"] = probe
    try:
        autoload.watch(name)
        __import__(name)
    finally:
        del sys.modules["h4_probe"]
        autoload._WATCHED.discard(name)
    assert probe.seen == ["yes"]
